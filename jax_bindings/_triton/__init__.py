"""The Triton backend: ACSR layouts -> specialised Triton kernels -> JAX custom calls (internal).

Modules, by concern (each imports only those above it, plus :mod:`acsr` and the shared modules
of :mod:`jax_bindings`: the tuning store, the disk cache, the split merge ...):

* :mod:`.spec`    -- :class:`~.spec.KernelSpec` / :class:`~.spec.Plan` of one kernel, built from
  the backend-neutral walk plan (:mod:`acsr._plan`), and the tile configuration
  (:class:`~.spec.Tiles`, :func:`~.spec.tiles_for`);
* :mod:`.cost`    -- tile candidates, their shared memory and registers, and the cost model
  ``splat tune`` ranks them by;
* :mod:`.grid_plan` -- spatial-tile plans (:class:`~.grid_plan.GridSpec`) of grid layouts (N-D
  neighborhoods);
* :mod:`.render`  -- Triton source text of a spec, one renderer per kernel op, from the shared
  source of :mod:`.tile_source` (the per-tile steps), :mod:`.kernel_lines` (the lines around a
  key walk) and :mod:`.grid_render` (the grid kernels);
* :mod:`.cache`   -- writes it to ``$SPLAT_CACHE_DIR`` (``~/.cache/splat/kernels``),
  imports it, caches by spec; ``SPLAT_DUMP_KERNELS=1`` dumps the source; disk caches of
  compiled PTX and cubins (``SPLAT_NO_DISK_CACHE=1`` turns them off);
* :mod:`.ops`     -- launch descriptions (:class:`~.ops.Call`) per op;
* :mod:`.launch`  -- numpy (Triton interpreter) and torch launchers;
* :mod:`.decode`  -- the decode and chunked-prefill kernel (query tokens at run-time positions
  against a KV cache), its plan and its :class:`~.ops.Call`;
* :mod:`.first_call` -- keeps Triton's first argument specialization from importing torch;
* :mod:`.backend` -- the backend contract of :mod:`jax_bindings._dispatch` through
  jax-triton (needs ``triton``, ``jax_triton`` and a CUDA JAX).

Everything but :mod:`.backend` runs on any machine (tests drive the generated
kernels through Triton's interpreter); the registry (:mod:`jax_bindings._registry`)
names ``jax_bindings._triton.backend``, whose import raises ``ImportError`` where
the backend cannot run.
"""
