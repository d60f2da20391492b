"""The CUDA C++ target: attention kernels generated as CUDA C++ for Hopper (sm_90a), launched from JAX.

Map, in the order to read it:

* :mod:`~jax_bindings._cuda.backend`: the backend contract: what the target takes, what it refuses
  (``NotImplementedError`` naming why) and, per call, plan -> compile -> launch; the decode route;
* :mod:`~jax_bindings._cuda.plan`: which kernel runs a call (:class:`~.plan.FwdVariant`,
  :class:`~.plan.GridFwdVariant`, :class:`~.plan.BwdVariant`), its cubin, launch grid and TMA
  templates; the measured choices of schedule, sections and key order live here;
* :mod:`~jax_bindings._cuda.source`, :mod:`~jax_bindings._cuda.bwd_source`: the forward's and the
  backward's generators: a variant's program (``kernels/fwd/fwd.cu`` or ``kernels/bwd/bwd.cu``
  with one generated header of its constants and ``wgmma`` instructions), shared memory, the
  kernels' signatures;
* :mod:`~jax_bindings._cuda.tile_shapes`: the tile shapes per head dim and dtype
  (``fwd_tile``, ``bwd_tile``) and the register and shared-memory budgets they fit;
* :mod:`~jax_bindings._cuda.parts`: how ``kernels/`` files become a program (``#include`` by
  name, the generated header, :meth:`~.parts.Program.flat`; ``SPLAT_DUMP_KERNELS=1`` prints it);
* :mod:`~jax_bindings._cuda.compiler`: NVRTC or nvcc -> cubin, kept on disk;
* :mod:`~jax_bindings._cuda.launch`: the JAX primitive that launches a cubin through jaxlib's
  kernel call; :mod:`~jax_bindings._cuda.tensor_map`: the TMA descriptors' host-side templates;
* :mod:`~jax_bindings._cuda.runtime_tables`: a runtime mask (lengths, segment ids, query
  positions) as the kernels read it, built in JAX;
* :mod:`~jax_bindings._cuda.phases`: a band in interleaved phases (dilated, strided) folded into
  heads, so that it runs as a band;
* :mod:`~jax_bindings._cuda.grid_tiles`: the forward's spatial tiles and tables on grid layouts
  (N-D neighborhoods);
* :mod:`~jax_bindings._cuda.bwd_passes`: the CUDA passes around the backward (``delta`` and
  ``lse2`` before it, ``dq`` in rows after it);
* :mod:`~jax_bindings._cuda.decode`: decode against a KV cache (a few query tokens at run-time
  positions, contiguous or paged): its variant, tile, splits and their merge.

``kernels/`` (package data, plain CUDA C++; each ``.cu`` opens with a glossary of its constants):

* ``common/``: parts any kernel may use: types and conversions, cp.async, mbarriers, TMA and bulk
  copies, ``wgmma`` and its shared-memory layout, ``mma.sync`` tiles (``mma_sm80.cuh``, decode),
  work tickets and sections, the band (``band.cuh``);
* ``fwd/``: the forward by concern: ``params``, ``shared`` (shared memory), ``tile_scheduler``,
  ``work`` (a work tile from its index), ``mask`` (band and runtime masks), ``mask_grid``,
  ``producer``, ``mainloop``, ``softmax``, ``epilogue``;
* ``bwd/``: the backward likewise, with ``dq_writer`` (the ordered sum of dQ);
* ``decode/``: the decode kernel: ``key_walk`` (an ACSR row at run-time positions), ``kv_rows``
  (contiguous and paged caches), ``warp_step`` (a warp's online softmax).

To add a head dim: add it to ``tile_shapes.HEAD_DIMS`` (and ``BWD_HEAD_DIMS`` where the backward's
accumulators fit: up to 128 columns a warpgroup holds all of an item's, past them the wide kernel
splits them by whole 64-column blocks, ``bwd/params.cuh``) and give its padded width a key tile in
``tile_shapes.FWD_BLOCK_N`` (time the candidates with ``benchmarks/bench_head_dims.py --tiles``);
the kernels read ``HEAD_DIM`` and ``HD`` (it padded to 64-column blocks) from the generated header.
Then run the NVRTC compile tests (``tests/test_cuda_tile_shapes.py``), the GPU tests (``pytest -m
gpu tests/test_cuda_head_dims_gpu.py``) and ``benchmarks/sanitize_cuda.py head_dims`` under
compute-sanitizer.

To add a mask form (a :class:`acsr.BandForm` that :func:`acsr.band_form` recognises): state it
in ``common/band.cuh`` and the walks of ``fwd/mask.cuh`` (``band_work``: the key tiles a row
block walks; ``BandMask``: the tiles and scores it masks) and ``bwd/mask.cuh`` (``band_walk``:
the query blocks a key block walks, never moving back from one key block to the next, as the
ordered dQ needs); its constant goes in the generated headers (``source.program``,
``bwd_source.program``, as ``band_block`` does); :func:`~.plan.band_form` accepts it and
:func:`~.plan.fwd_variant` / :func:`~.plan.bwd_variant` bake it into the variant. A form that is
a band after a reshape needs no kernel change (:mod:`~jax_bindings._cuda.phases`).

To add a schedule: write how CTAs get work tiles in ``fwd/tile_scheduler.cuh`` (``place``,
``scheduled``; its ``SCHEDULE`` value in ``fwd/params.cuh``; tickets, if it takes them, come
through ``fwd/producer.cuh`` and ``common/work_tickets.cuh``), name it in ``source.SCHEDULES``
(and ``source.takes_tickets`` if it reads ``sem``), its CTAs in :func:`~.plan.grid`, and
let :func:`~.plan.fwd_variant` pick it where it measures faster (:func:`~.plan.rescheduled`
runs any variant in it, for the tests).

Only the backend module needs a GPU (its import raises ImportError elsewhere); the generators,
the planner and the compiler run anywhere, so every variant compiles in the CPU tests.
"""
