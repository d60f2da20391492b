"""The Triton backend: ACSR layouts -> specialised Triton kernels -> JAX custom calls (internal).

Modules, by concern (each imports only those above it, plus :mod:`acsr`):

* :mod:`.spec`    -- :class:`~.spec.KernelSpec` / :class:`~.spec.Plan` of one kernel, built from
  the backend-neutral walk plan (:mod:`acsr._plan`), and the tile configuration
  (:class:`~.spec.Tiles`, :func:`~.spec.tiles_for`);
* :mod:`.render`  -- Triton source text of a spec, one renderer per kernel op;
* :mod:`.cache`   -- writes it to ``$SPLAT_CACHE_DIR`` (``~/.cache/splat/kernels``),
  imports it, caches by spec; ``SPLAT_DUMP_KERNELS=1`` dumps the source; disk caches of
  compiled PTX and cubins (``SPLAT_NO_DISK_CACHE=1`` turns them off);
* :mod:`.ops`     -- launch descriptions (:class:`~.ops.Call`) per op;
* :mod:`.launch`  -- numpy (Triton interpreter) and torch launchers;
* :mod:`.backend` -- the backend contract of :mod:`jax_bindings._dispatch` through
  jax-triton (needs ``triton``, ``jax_triton`` and a CUDA JAX).

Everything but :mod:`.backend` runs on any machine (tests drive the generated
kernels through Triton's interpreter); the registry (:mod:`jax_bindings._registry`)
names ``jax_bindings._triton.backend``, whose import raises ``ImportError`` where
the backend cannot run.
"""
