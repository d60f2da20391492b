"""The Triton backend: generated kernels as JAX custom calls (jax-triton).

Implements the backend contract of :mod:`jax_bindings._dispatch` (which adds
``custom_vjp`` and ``custom_vmap``). Every function runs at trace time:
it derives a :class:`~jax_bindings._triton.spec.KernelSpec` from the static ``layout`` and
the shapes, loads the generated kernel (cached by spec) and binds it with
``jax_triton.triton_call``. Per-row metadata (arrays of segments without a
closed form, the stride-phase row permutation, the residual's block lists)
goes in as extra operands, constants of the traced program. Queries at run-time
positions (decode against a KV cache, contiguous or paged) run on the decode
kernel of :mod:`jax_bindings._triton.decode` (:func:`decode_forward`).

Importing this module needs ``triton`` and ``jax_triton`` and a CUDA JAX; it
raises ImportError otherwise (the dispatcher then uses the ``"jax"`` backend).

Nothing here catches planning errors: the planner (:func:`~jax_bindings._triton.spec.plan`)
raises ``NotImplementedError`` for calls the kernels cannot take (head dim > 256,
residual blocks they cannot tile), on which ``backend="auto"`` falls back to the
``"jax"`` backend, and ``ValueError`` / ``TypeError`` for bad arguments, which
reach the caller.

Importing it also puts :class:`~jax_bindings._triton.cache.CompileCache` around
jax-triton's compile step (see :func:`_install_compile_cache`): compiled kernels
(PTX) are kept in ``<splat cache dir>/triton/`` and a new process reuses them;
and it hands jaxlib each kernel's cubin, kept in ``<splat cache dir>/cubin/``,
so a new process does not run ptxas either (:func:`_install_module_images`).
``SPLAT_NO_DISK_CACHE=1`` turns both off.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from acsr import ACSR
from jax_bindings import _id_runs, _kernel_proto, _pure
from jax_bindings._triton import cache as _cache
from jax_bindings._triton import decode, first_call, ops
from jax_bindings._triton.spec import transpose_slots, transposed

# jax_triton 0.3.x sets TRITON_CACHE_DIR="" at import, for the whole process: every later
# Triton compile outside jax_triton (torch.compile / FlexAttention, Triton's own driver
# helpers) then fails with "Could not create or locate cache dir". Put the variable back.
_CACHE_ENV = os.environ.get("TRITON_CACHE_DIR")
try:
    import jax_triton as _jt
    import triton as _triton
except Exception as e:  # jax_triton raises more than ImportError on CPU-only JAX
    raise ImportError(
        f"the triton backend needs triton and jax_triton on a CUDA JAX ({type(e).__name__}: {e})"
    ) from e
finally:
    if os.environ.get("TRITON_CACHE_DIR") == "":
        if _CACHE_ENV:
            os.environ["TRITON_CACHE_DIR"] = _CACHE_ENV
        else:  # unset (or blanked by an earlier jax_triton import): Triton's default folder
            del os.environ["TRITON_CACHE_DIR"]


_log = logging.getLogger(__name__)
_COMPILE_ARGS = ["ttir", "backend", "options", "compute_capability", "platform"]


def _install_compile_cache() -> bool:
    """Wraps ``jax_triton.triton_lib.compile_ttir_inplace`` in a :class:`.cache.CompileCache`.

    jax-triton 0.3.x compiles TTIR -> PTX in ``get_or_create_triton_kernel``,
    which calls the module-level ``compile_ttir_inplace(ttir, backend, options,
    compute_capability, platform)`` after its in-memory cache missed; replacing
    that global adds a disk cache under it. Installed only when jax-triton looks
    exactly like that (function name, parameters, the call site, a dataclass
    result) and does not dump IR (``JAX_TRITON_DUMP_DIR``: dumps need a real
    compile); otherwise jax-triton is left alone and one debug line says why.
    Returns whether the cache is in place.

    jaxlib then assembles the PTX to a cubin (ptxas) at each kernel's first
    launch in every process, with an in-memory cache only, unless the cubin is
    handed over (:func:`_install_module_images`).
    """
    try:
        from jax_triton import triton_lib as tl_lib

        fn = getattr(tl_lib, "compile_ttir_inplace", None)
        if isinstance(fn, _cache.CompileCache):
            return True
        caller = getattr(tl_lib, "get_or_create_triton_kernel", None)
        result = getattr(tl_lib, "CompilationResult", None)
        why = None
        if not callable(fn) or getattr(fn, "__name__", "") != "compile_ttir_inplace":
            why = "no compile_ttir_inplace function"
        elif list(inspect.signature(fn).parameters) != _COMPILE_ARGS:
            why = f"compile_ttir_inplace{inspect.signature(fn)} is not ({', '.join(_COMPILE_ARGS)})"
        elif "compile_ttir_inplace" not in getattr(getattr(caller, "__code__", None), "co_names", ()):
            why = "get_or_create_triton_kernel does not call compile_ttir_inplace"
        elif not (isinstance(result, type) and dataclasses.is_dataclass(result)):
            why = "no CompilationResult dataclass"
        elif getattr(tl_lib, "_JAX_TRITON_DUMP_DIR", None):
            why = "JAX_TRITON_DUMP_DIR is set"
        if why:
            _log.debug("splat: jax-triton's compiles are not cached on disk: %s", why)
            return False
        salt = f"triton={_triton.__version__};jax_triton={getattr(_jt, '__version__', '?')}"
        tl_lib.compile_ttir_inplace = _cache.CompileCache(fn, result, salt=salt)
        return True
    except Exception as e:  # a jax-triton we do not know: run it as it is
        _log.debug("splat: jax-triton's compiles are not cached on disk (%s: %s)", type(e).__name__, e)
        return False


COMPILE_CACHE_INSTALLED = _install_compile_cache()


# -- cubins handed to jaxlib ----------------------------------------------------------
#
# jax-triton's custom call carries the kernel's PTX (jax_bindings._kernel_proto);
# jaxlib assembles it (ptxas) at the first launch in every process and keeps the
# cubin in memory only. jaxlib releases that know ``TritonKernel.module_image``
# load a cubin given there instead. So splat assembles each of its kernels once with
# Triton's own ptxas, keeps the cubin on disk (jax_bindings._triton.cache.module_image)
# and attaches it in the lowering. Older jaxlibs would ignore the field; splat does
# not attach it for them.


def _jaxlib_takes_module_images() -> bool:
    """Whether the loaded jaxlib Triton extension knows ``TritonKernel.module_image``."""
    for name, mod in list(sys.modules.items()):
        path = getattr(mod, "__file__", None) or ""
        if "triton" in name and path.endswith(".so") and "jax" in path:
            try:
                with open(path, "rb") as f:
                    if b"module_image" in f.read():
                        return True
            except OSError:
                continue
    return False


@functools.cache
def _assembler(compute_capability: int):
    """``(assemble(ptx) -> cubin, arch, salt)`` with Triton's ptxas, as Triton builds its own cubins.

    Cached: the salt asks ptxas its version (a subprocess), once per process, not per lowering."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    backend = CUDABackend(GPUTarget("cuda", compute_capability, 32))
    opts = backend.parse_options({})
    arch = f"sm_{compute_capability}{'a' if compute_capability >= 90 else ''}"
    salt = f"triton={_triton.__version__};{backend.hash()}"
    return (lambda ptx: backend.make_cubin(ptx, {}, opts, compute_capability)), arch, salt


def _cubin_for(ptx: str, compute_capability: int) -> bytes | None:
    try:
        assemble, arch, salt = _assembler(compute_capability)
        return _cache.module_image(ptx, arch, assemble, salt=salt)
    except Exception as e:  # no ptxas, an unknown Triton: jaxlib assembles the PTX itself
        _log.debug("splat: no cubin for a kernel, jaxlib assembles it (%s: %s)", type(e).__name__, e)
        return None


def _install_module_images() -> bool:
    """Re-registers jax-triton's CUDA lowering so splat's kernels carry their cubin.

    Only for kernels generated by splat (module ``_splat_kernel_*``), only when
    the loaded jaxlib reads module images and jax-triton looks as expected;
    ``SPLAT_NO_DISK_CACHE=1`` also turns it off. Returns whether it is in place.
    """
    try:
        from jax_triton import triton_lib as tl_lib

        base = functools.partial(tl_lib.triton_kernel_call_lowering, tl_lib.get_cuda_backend)
        prim = tl_lib.triton_kernel_call_p
    except Exception as e:
        _log.debug("splat: kernels are assembled by jaxlib (%s: %s)", type(e).__name__, e)
        return False
    if _cache._disabled() or not _jaxlib_takes_module_images():
        return False

    def lowering(ctx, *args, **params):
        first_call.specialize_without_torch()
        results = base(ctx, *args, **params)
        fn = getattr(params.get("fn"), "fn", None)
        if not getattr(fn, "__module__", "").startswith("_splat_kernel_") or not results:
            return results
        try:
            owner = results[0].owner
            op = getattr(owner, "operation", owner)
            old = zlib.decompress(mlir.ir.StringAttr(op.attributes["backend_config"]).value_bytes)
            new = _kernel_proto.with_module_image(old, _cubin_for)
            if new != old:
                op.attributes["backend_config"] = mlir.ir.StringAttr.get(zlib.compress(new))
        except Exception as e:  # leave the call as jax-triton built it
            _log.debug("splat: kernel left without a cubin (%s: %s)", type(e).__name__, e)
        return results

    mlir.register_lowering(prim, lowering, platform="cuda")
    return True


MODULE_IMAGES_INSTALLED = _install_module_images()


# contract ops that take grid layouts (N-D neighborhoods) as they are: the spatial-tile kernels
GRID_OPS = ("attention_fwd", "attention_bwd")


def run_call(call: ops.Call, *data) -> list[jax.Array]:
    out_shape = [jax.ShapeDtypeStruct(s, jnp.dtype(d)) for s, d in call.out]
    outs = _jt.triton_call(
        *data,
        *(jnp.asarray(m) for m in call.meta),
        kernel=call.kernel,
        out_shape=out_shape,
        grid=call.grid,
        num_warps=call.num_warps,
        num_stages=call.num_stages,
        zeroed_outputs=call.zeroed,
        **call.constexprs,
    )
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]


def _dtype(x) -> str:
    return jnp.dtype(x.dtype).name


def _group_sum(x: jax.Array, hkv: int, dtype) -> jax.Array:
    """``[B, S, H, D]`` -> ``[B, S, Hkv, D]`` summing the query heads of each KV head."""
    B, S, H, D = x.shape
    if H == hkv:
        return x.astype(dtype)
    return x.astype(jnp.float32).reshape(B, S, hkv, H // hkv, D).sum(3).astype(dtype)


def _transpose_values(vals: jax.Array, layout: ACSR) -> jax.Array:
    """Values ``[B, H, Sq, N]`` of ``layout`` -> ``[B, H, Skv, N_T]`` of its transpose."""
    idx = transpose_slots(layout)
    B, H, Sq, N = vals.shape
    flat = jnp.concatenate([vals.reshape(B, H, Sq * N), jnp.zeros((B, H, 1), vals.dtype)], axis=2)
    idx_j = jnp.asarray(idx.reshape(-1).astype(np.int32 if idx.max(initial=0) < 2**31 else np.int64))
    return jnp.take(flat, idx_j, axis=2).reshape(B, H, *idx.shape)


# -- fused attention -------------------------------------------------------------


def _runtime(runtime) -> str:
    """The kernels' runtime-mask kind for ``runtime``; refuses what they cannot take."""
    if runtime is None:
        return ""
    if runtime.q_pos is not None:
        raise NotImplementedError(
            "the triton kernels take q_offset in decode only (the prefill kernels' static rows are fixed at "
            "compile time)"
        )
    return "ids" if runtime.q_ids is not None else "ranges"


def _rt_operands(runtime, *, keys: bool) -> tuple:
    """The runtime mask's operands for the query-row kernels, or (``keys``) the dk/dv kernel."""
    if runtime is None:
        return ()
    r = runtime
    lens = (r.kv_len, r.q_len) if keys else (r.q_len, r.kv_len)
    ids = () if r.q_ids is None else ((r.kv_ids, r.q_ids) if keys else (r.q_ids, r.kv_ids))
    return (*lens, r.exact, *ids)


def _sm_count() -> int:
    """Streaming multiprocessors of the default GPU (132, an H100 SXM's, where jaxlib does not say)."""
    return int(getattr(jax.devices()[0], "core_count", 132))


def decode_forward(q, k, v, runtime, layout: ACSR, scale: float, soft_cap=None, page_table=None, splits=None):
    """``(out [B, Sq, H, D], lse [B, H, Sq])`` of the decode kernel (:mod:`jax_bindings._triton.decode`)
    at ``runtime.q_pos``, over a contiguous cache ``k, v [B, L, Hk, D]`` or a page pool ``[P,
    page_size, Hk, D]`` with ``page_table [B, max_pages]``; NotImplementedError for what it does not
    take (:func:`decode.refusal`). ``splits``: of each row's walk (None: as
    :func:`decode.plan` plans them)."""
    dt = _dtype(q)
    why = decode.refusal(layout, q.shape, k.shape[2], dt)
    if why is not None:
        raise NotImplementedError(why)
    paged = page_table is not None
    keys = page_table.shape[1] * k.shape[1] if paged else k.shape[1]
    if keys < layout.kv_len or (not paged and keys != layout.kv_len):
        raise ValueError(f"the layout's {layout.kv_len} rows do not match the cache's {keys} keys")
    ids = runtime.q_ids is not None
    p = decode.plan(q.shape, k.shape[2], dt, layout, scale, soft_cap, _sm_count(),
                    page_size=k.shape[1] if paged else 0, max_pages=page_table.shape[1] if paged else 0,
                    n_pages=k.shape[0] if paged else 0, ids=ids, splits=splits)
    i32 = jnp.int32
    none = jnp.zeros((1,), i32)
    table = page_table.astype(i32) if paged else none
    id_args = (runtime.q_ids.astype(i32), runtime.kv_ids.astype(i32),
               _id_runs.document_keys(runtime, layout.kv_len)) if ids else (none, none, none)
    out, lse, *_scratch = run_call(
        decode.call(p), q, k.astype(q.dtype), v.astype(q.dtype), runtime.q_pos.astype(i32),
        runtime.q_len.astype(i32), runtime.kv_len.astype(i32), jnp.asarray(decode.segment_table(layout)),
        table, *id_args)
    return out, lse


def attention_fwd(q, k, v, runtime, layout: ACSR, scale: float, soft_cap=None):
    """``(out [B, Sq, H, D], lse [B, H, Sq] float32)`` from the fused forward kernel; queries at
    run-time positions (decode) from the decode kernel (:func:`decode_forward`)."""
    if runtime is not None and runtime.q_pos is not None:
        return decode_forward(q, k, v, runtime, layout, scale, soft_cap)
    rt = _runtime(runtime)
    call = ops.fwd_call(layout, q.shape, k.shape, _dtype(q), scale, runtime=rt, soft_cap=soft_cap)
    out, lse = run_call(call, q, k, v.astype(q.dtype), *_rt_operands(runtime, keys=False))
    return out, lse


def attention_bwd(q, k, v, runtime, out, lse, dout, layout: ACSR, scale: float, soft_cap=None):
    """``(dq, dk, dv)`` from the fused backward kernels (dq over ``layout``, dk/dv over its transpose)."""
    rt = _runtime(runtime)
    dt = q.dtype
    kd, vd = k.dtype, v.dtype
    cq, ck = ops.bwd_calls(layout, q.shape, k.shape, _dtype(q), scale, runtime=rt, soft_cap=soft_cap)
    k, v, dout, lse = k.astype(dt), v.astype(dt), dout.astype(dt), lse.astype(jnp.float32)
    # delta = rowsum(dout * out), in-kernel
    dq, delta = run_call(cq, q, k, v, dout, out.astype(dt), lse, *_rt_operands(runtime, keys=False))
    dk, dv = run_call(ck, q, k, v, dout, lse, delta, *_rt_operands(runtime, keys=True))
    return dq, dk.astype(kd), dv.astype(vd)


def attention_paged(q, k_pages, v_pages, page_table, runtime, layout: ACSR, scale: float, soft_cap=None):
    """``out [B, Sq, H, D]`` of the decode kernel over a paged KV cache (the contract's
    ``attention_paged``); longer chunks are refused (the prefill kernels read contiguous keys)."""
    return decode_forward(q, k_pages, v_pages, runtime, layout, scale, soft_cap, page_table)[0]


# -- unfused ops -------------------------------------------------------------------


def sddmm(q, k, layout: ACSR):
    """Scores ``[B, H, Sq, N]`` in q's dtype (no scale; padding 0)."""
    (s,) = run_call(ops.sddmm_call(layout, q.shape, k.shape, _dtype(q)), q, k.astype(q.dtype))
    return s


def softmax(scores, layout: ACSR, scale: float):
    """Row softmax of ``scale * scores`` over each row's valid slots."""
    (p,) = run_call(ops.softmax_call(layout, scores.shape, _dtype(scores), scale), scores)
    return p


def spmm(probs, v, layout: ACSR):
    """``probs . v`` -> ``[B, Sq, H, D]`` in v's dtype."""
    (o,) = run_call(ops.spmm_call(layout, probs.shape, v.shape, _dtype(v)), probs, v)
    return o


def sddmm_bwd(q, k, ds, layout: ACSR):
    """``dq = ds . k`` over ``layout``; ``dk = ds^T . q`` over the transposed layout."""
    dq = spmm(ds, k.astype(q.dtype), layout).astype(q.dtype)
    dst = _transpose_values(ds, layout)
    dk = spmm(dst, q, transposed(layout))
    return dq, _group_sum(dk, k.shape[2], k.dtype)


def softmax_bwd(probs, dprobs, layout: ACSR, scale: float):
    """Elementwise JAX, shared with the pure backend (padding slots masked out of the row sums)."""
    return _pure.softmax_bwd(probs, dprobs, layout, scale)


def spmm_bwd(probs, v, dout, layout: ACSR):
    """``dprobs = dout . v^T`` at the mask (SDDMM); ``dv = probs^T . dout`` over the transpose."""
    dp = sddmm(dout.astype(v.dtype), v, layout).astype(probs.dtype)
    pt = _transpose_values(probs, layout)
    dv = spmm(pt, dout.astype(v.dtype), transposed(layout))
    return dp, _group_sum(dv, v.shape[2], v.dtype)
