"""The CUDA C++ target: attention kernels generated as CUDA C++ for Hopper (sm_90a).

* :mod:`~jax_bindings._cuda.source`: the generator (a diagonal band baked in; ``wgmma``, TMA,
  a producer warpgroup and two ping-ponged consumer warpgroups);
* :mod:`~jax_bindings._cuda.compiler`: NVRTC or nvcc -> cubin, kept on disk;
* :mod:`~jax_bindings._cuda.tensor_map`: the TMA descriptors' host-side templates;
* :mod:`~jax_bindings._cuda.launch`: the JAX primitive that launches a cubin through jaxlib's
  kernel call;
* :mod:`~jax_bindings._cuda.grid_tiles`: the forward's spatial tiles and tables on grid
  layouts (N-D neighborhoods);
* :mod:`~jax_bindings._cuda.phases`: a band in interleaved phases (dilated, strided) folded
  into heads, so that it runs as a band;
* :mod:`~jax_bindings._cuda.runtime_tables`: a runtime mask (lengths, segment ids) as the
  kernels read it, built in JAX;
* :mod:`~jax_bindings._cuda.parts`: kernels kept as CUDA source files under ``kernels/``
  (``common/`` parts any kernel may include, ``decode/`` the decode kernel and its parts), composed
  by ``#include`` with one generated header of a variant's constants;
* :mod:`~jax_bindings._cuda.decode`: decode against a KV cache (queries at run-time positions,
  contiguous or paged caches): the variant, its tile, the split plan and the merge of the splits;
* :mod:`~jax_bindings._cuda.backend`: the backend contract (imports only where a Hopper GPU,
  a compiler and the driver's tensor maps are present).

Only the backend module needs a GPU; the generator and the compiler run anywhere.
"""
