"""The CUDA backend: generated CUDA C++ attention kernels for Hopper, launched from JAX.

Implements the backend contract of :mod:`jax_bindings._dispatch` for the fused attention on the
masks that are one diagonal band in one of its forms (:func:`acsr.band_form`: dense, causal --
top-left or bottom-right aligned --, causal windows, sliding windows, bands off the diagonal;
bands measured from blocks of rows, as block-local; bands in interleaved phases, as dilated
windows and strided, folded into heads by :mod:`jax_bindings._cuda.phases`), the head dims of
:data:`~jax_bindings._cuda.tile_shapes.HEAD_DIMS` (the backward: ``BWD_HEAD_DIMS``), bfloat16
or float16, on a GPU of compute capability 9.0 (H100, H200). Queries at run-time positions
(``q_offset``: decode and speculative decoding against a KV cache, contiguous or paged) run on
the decode route the numbers favour (:func:`decode_route`): the Triton decode kernel
(:mod:`jax_bindings._triton.decode`) wherever it takes the call, the CUDA decode kernel
(:mod:`jax_bindings._cuda.decode`) for head dims that are no power of two; longer chunks
at an offset (chunked prefill) on the forward band kernel shifted to the chunk's rows, on plain
bands. Everything else is refused with ``NotImplementedError`` naming why, so ``backend="auto"``
moves on (to the Triton backend): other masks, head dims and dtypes, longer chunks at an offset
on other masks, the backward at an offset and the unfused ops. Runtime
masks of lengths and segment ids are taken on plain bands (:mod:`jax_bindings._cuda.runtime_tables`). The
backward (:mod:`jax_bindings._cuda.bwd_source`, through :func:`run_backward`) is offered on the
bands :func:`~jax_bindings._cuda.plan.offered_bwd_variant` names (dense, causal, windows of
640 rows and more with a key block, 576 at head dim 256); the backward of a narrower window's
forward run here goes to the next backend (``out`` and ``lse`` mean the same from every
backend). Grid layouts (N-D
neighborhoods, :mod:`acsr._grid`) run on the forward's spatial tiles
(:mod:`jax_bindings._cuda.grid_tiles`); their backward goes to the next backend.

Per call, at trace time: the band and the shapes pick a :class:`~jax_bindings._cuda.plan.FwdVariant`
(:mod:`jax_bindings._cuda.plan`); its source
(:func:`jax_bindings._cuda.source.source`) is compiled once (disk cache:
:mod:`jax_bindings._cuda.compiler`) and launched through :mod:`jax_bindings._cuda.launch`
with the K/V tensor-map templates (:mod:`jax_bindings._cuda.tensor_map`) as a constant input.

Importing this module raises ImportError where it cannot run: no CUDA jaxlib kernel call, no
GPU of compute capability 9.0, no CUDA compiler, no driver tensor maps.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from acsr import ACSR
from jax_bindings._cuda import (
    bwd_passes,
    bwd_source,
    compiler,
    decode,
    grid_tiles,
    launch,
    phases,
    plan,
    runtime_tables,
    source,
    tensor_map,
)


def _why_not_here() -> str | None:
    try:
        from jax._src.lib import gpu_triton as tk

        tk.TritonKernel  # noqa: B018 -- only a CUDA jaxlib has the kernel call
    except (ImportError, AttributeError) as e:
        return f"jaxlib has no CUDA kernel call ({type(e).__name__}: {e})"
    try:
        devices = jax.devices("gpu")
    except RuntimeError as e:
        return f"no GPU ({e})"
    cc = getattr(devices[0], "compute_capability", None)
    if cc != "9.0":
        return f"the kernels are built for sm_90a (H100, H200); this GPU's compute capability is {cc}"
    c = compiler.compiler()
    if isinstance(c, str):
        return c
    return tensor_map.available()


_WHY = _why_not_here()
if _WHY is not None:
    raise ImportError(f"the cuda backend cannot run here: {_WHY}")

LOG2E = math.log2(math.e)


def _sm_count() -> int:
    """Streaming multiprocessors of the default GPU (the forward's grid size; an H100 SXM's 132
    where jaxlib does not say)."""
    return int(getattr(jax.devices("gpu")[0], "core_count", 132))


def _runtime_kind(runtime, *, positions: bool = False) -> str:
    """The kernels' runtime kind for ``runtime``; refuses what they cannot take (query positions
    unless ``positions``: the forward takes them, the backward does not)."""
    return runtime_tables.kind(runtime, positions=positions)


def _ctas(grid: tuple[int, int, int], slot_bytes: int) -> int:
    """CTAs of ``grid``; refuses a grid whose tensor-map slots (``slot_bytes`` each) need 2 GiB."""
    n = grid[0] * grid[1] * grid[2]
    if n * slot_bytes >= 2**31:
        raise NotImplementedError(f"grid {grid}: its tensor-map slots would need 2**31 bytes or more")
    return n


def run_forward(name: str, image: bytes, grid: tuple[int, int, int], smem: int, maps: bytes, q, k, v,
                scale: float, rt_arrays: tuple = (), *, zero_ticket: bool = True,
                threads: int = source.THREADS):
    """``(out, lse)`` of the forward kernel ``name`` in the cubin ``image``, launched on ``grid``
    (:func:`~jax_bindings._cuda.plan.grid` of the kernel's schedule) with ``smem`` bytes of shared
    memory and the tensor-map templates ``maps`` (the kernel signature of
    :mod:`jax_bindings._cuda.source`); ``rt_arrays``: the arrays the kernel takes after the
    templates: the runtime mask's (:func:`~jax_bindings._cuda.runtime_tables.fwd_arrays`), or a
    grid layout's tables (:func:`~jax_bindings._cuda.grid_tiles.grid_plan`); ``threads``: the
    variant's CTA size (its ``threads``). ``zero_ticket``:
    zero the ticket counter ``sem`` before the launch, as a schedule that takes tickets needs
    (:func:`~jax_bindings._cuda.source.takes_tickets`; elsewhere a memset and its gap for nothing)."""
    B, Sq, H, D = q.shape
    n_ctas = _ctas(grid, source.SLOT_BYTES)
    spec = launch.Launch(
        name=name,
        image=image,
        grid=grid,
        threads=threads,
        smem=smem,
        scalars=(("i32", Sq), ("i32", k.shape[1]), ("i32", H), ("i32", k.shape[2]), ("i32", B),
                 ("fp32", float(scale) * LOG2E)),
        outs=(((B, Sq, H, D), jnp.dtype(q.dtype).name), ((B, H, Sq), "float32"), ((1,), "int32"),
              ((n_ctas * source.SLOT_BYTES,), "uint8")),
        cc=90,
        zeroed=(2,) if zero_ticket else (),
    )
    templates = jnp.asarray(np.frombuffer(maps, dtype=np.uint8))
    out, lse, _sem, _slots = launch.run(spec, q, k.astype(q.dtype), v.astype(q.dtype), templates, *rt_arrays)
    return out, lse


# Grid layouts (N-D neighborhoods) reach both fused ops as they are: the forward runs them on
# spatial tiles (grid_tiles); the backward refuses them by name, so it goes to the next backend.
GRID_OPS = ("attention_fwd", "attention_bwd")


def _grid_forward(q, k, v, layout: ACSR, scale: float, rt: str, soft_cap):
    variant = plan.grid_fwd_variant(layout, q.shape[-1], jnp.dtype(q.dtype).name, rt, soft_cap)
    name, image = plan.compiled(variant)
    tiles = variant.tiles
    grid = plan.grid(q.shape, variant.schedule, _sm_count(), tiles.n_patches)
    maps = plan.grid_tensor_maps(tiles, q.shape, k.shape, v.shape)
    tables = jnp.asarray(grid_tiles.grid_plan(layout.grid).tables)
    return run_forward(name, image, grid, variant.smem, maps, q, k, v, scale, (tables,),
                       zero_ticket=source.takes_tickets(variant.schedule), threads=variant.threads)


@functools.cache
def _triton_backend():
    """The Triton backend module, or None where it cannot load here (no triton, no jax-triton)."""
    try:
        from jax_bindings._triton import backend
    except ImportError:
        return None
    return backend


def decode_route(q, k, v, runtime, layout: ACSR, scale: float, soft_cap, page_table=None):
    """``(out, lse)`` of decode on the kernel measured faster for the call: the Triton decode kernel
    wherever it takes it (up to four segments of runs or progressions of keys; contiguous or paged;
    segment ids; 1.03-1.32x this backend's decode kernel on H100 and H200,
    :func:`jax_bindings._triton.decode.preferred`), else the CUDA decode kernel (head dims that are
    no power of two)."""
    triton = _triton_backend()
    dtype = jnp.dtype(q.dtype).name
    if triton is not None and triton.decode.preferred(layout, q.shape, k.shape[2], dtype):
        return triton.decode_forward(q, k, v, runtime, layout, scale, soft_cap, page_table)
    return decode.forward(q, k, v, runtime, layout, scale, soft_cap, _sm_count(), page_table=page_table)


def attention_fwd(q, k, v, runtime, layout: ACSR, scale: float, soft_cap=None):
    """``(out [B, Sq, H, D], lse [B, H, Sq] float32)`` from the generated forward kernel (a band
    in phases on the arrays folded, :mod:`jax_bindings._cuda.phases`). Queries at run-time
    positions (``runtime.q_pos``): up to :data:`decode.MAX_TOKENS` a batch row (decode against a
    KV cache) from :func:`decode_route`, on every layout of segments; longer chunks at an offset
    (chunked prefill) from the band kernel shifted to the chunk's rows (plain bands)."""
    positions = runtime is not None and runtime.q_pos is not None
    if positions and q.shape[1] <= decode.MAX_TOKENS:
        return decode_route(q, k, v, runtime, layout, scale, soft_cap)
    rt = _runtime_kind(runtime, positions=True)
    if layout.grid is not None:
        if positions:
            raise NotImplementedError("the cuda grid forward takes no query positions (q_offset)")
        return _grid_forward(q, k, v, layout, scale, rt, soft_cap)
    dtype = jnp.dtype(q.dtype).name
    d = plan.band_form(layout, q.shape[-1], dtype, rt).phases
    variant = plan.fwd_variant(layout, q.shape[-1], dtype, rt, shifted=positions, soft_cap=soft_cap)
    if d > 1:
        q, k, v = (phases.fold(x, d) for x in (q, k, v))
    name, image = plan.compiled(variant)
    grid = plan.grid(q.shape, variant.schedule, _sm_count())
    maps = plan.tensor_maps(variant.block_n, q.shape, k.shape, v.shape)
    rt_arrays = runtime_tables.fwd_arrays(runtime, variant.block_n, layout.q_len) if rt else ()
    out, lse = run_forward(name, image, grid, variant.smem, maps, q, k, v, scale, rt_arrays,
                           zero_ticket=source.takes_tickets(variant.schedule), threads=variant.threads)
    return (phases.unfold(out, d), phases.unfold_rows(lse, d)) if d > 1 else (out, lse)


def run_backward(name: str, image: bytes, smem: int, maps: bytes, q, k, v, out, lse, dout, scale: float,
                 rt_arrays: tuple = (), *, ordered: bool, threads: int = bwd_source.THREADS):
    """``(dq, dk, dv)`` from the backward kernel ``name`` in the cubin ``image`` (the kernel
    signature of :mod:`jax_bindings._cuda.bwd_source`); ``lse`` as the forward gave it;
    ``rt_arrays`` as :func:`~jax_bindings._cuda.runtime_tables.bwd_arrays` gives them;
    ``ordered``: the kernel's dQ order (an ordered kernel stores each block's first part, so its
    ``dq_acc`` is not zeroed before the launch); ``threads``: the variant's CTA size."""
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    grid = plan.bwd_grid(k.shape, _sm_count())
    n_ctas = _ctas(grid, bwd_source.SLOT_BYTES)
    # lse2: per row, in base 2; +inf where the row sees no key and on the padding, so P = 0 there
    delta, lse2 = bwd_passes.delta_lse2(out.astype(q.dtype), dout, lse)
    dt = jnp.dtype(q.dtype).name
    spec = launch.Launch(
        name=name,
        image=image,
        grid=grid,
        threads=threads,
        smem=smem,
        scalars=(("i32", Sq), ("i32", Skv), ("i32", H), ("i32", Hkv), ("i32", B),
                 ("fp32", float(scale) * LOG2E), ("fp32", float(scale))),
        outs=(((B, Skv, Hkv, D), dt), ((B, Skv, Hkv, D), dt),
              (bwd_source.dq_acc_shape(B, H, Sq, D), "float32"),
              ((bwd_source.sem_words(B, H, Sq),), "int32"), ((n_ctas * bwd_source.SLOT_BYTES,), "uint8")),
        cc=90,
        zeroed=(3,) if ordered else (2, 3),
    )
    templates = jnp.asarray(np.frombuffer(maps, dtype=np.uint8))
    dk, dv, dq_acc, _sem, _slots = launch.run(
        spec, q, k.astype(q.dtype), v.astype(q.dtype), dout.astype(q.dtype), lse2, delta, templates,
        *rt_arrays)
    dq = bwd_passes.dq_rows(dq_acc, lse2, Sq, scale, q.dtype, D)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype)


def attention_bwd(q, k, v, runtime, out, lse, dout, layout: ACSR, scale: float, soft_cap=None):
    """``(dq, dk, dv)`` from the generated backward kernel, on the bands
    :func:`~jax_bindings._cuda.plan.offered_bwd_variant` offers it for (folded as the forward)."""
    rt = _runtime_kind(runtime)
    dtype = jnp.dtype(q.dtype).name
    d = plan.band_form(layout, q.shape[-1], dtype, rt).phases
    variant = plan.offered_bwd_variant(layout, q.shape[-1], dtype, rt, soft_cap)
    if d > 1:
        q, k, v, out, dout = (phases.fold(x, d) for x in (q, k, v, out, dout))
        lse = phases.fold_rows(lse, d)
    name, image = plan.compiled(variant)
    maps = plan.bwd_tensor_maps(q.shape, k.shape)
    rt_arrays = runtime_tables.bwd_arrays(runtime, variant.block_n) if rt else ()
    dq, dk, dv = run_backward(name, image, variant.smem, maps, q, k, v, out, lse, dout, scale, rt_arrays,
                              ordered=variant.ordered, threads=variant.threads)
    return (phases.unfold(dq, d), phases.unfold(dk, d), phases.unfold(dv, d)) if d > 1 else (dq, dk, dv)


def attention_paged(q, k_pages, v_pages, page_table, runtime, layout: ACSR, scale: float, soft_cap=None):
    """``out [B, Sq, H, D]`` over a paged KV cache (the contract's ``attention_paged``): decode
    (:func:`decode_route`) reads the pages in place; a longer chunk (chunked prefill) gathers them into a
    contiguous cache and runs the shifted band kernel, where the gather's bytes are a small part
    of the chunk's work (a page of 16 keys is read once for every query of the chunk)."""
    if q.shape[1] <= decode.MAX_TOKENS:
        return decode_route(q, k_pages, v_pages, runtime, layout, scale, soft_cap, page_table)[0]
    if runtime.q_ids is not None:
        raise NotImplementedError(
            "the cuda backend runs a paged chunk longer than the decode kernel's "
            f"{decode.MAX_TOKENS} tokens without segment ids only")
    n_pages, page_size = k_pages.shape[:2]
    b, max_pages = page_table.shape
    page_ok = (page_table >= 0) & (page_table < n_pages)
    pages = jnp.clip(page_table, 0, n_pages - 1)
    k, v = (x[pages].reshape(b, max_pages * page_size, *x.shape[2:]) for x in (k_pages, v_pages))
    # keys of a page id outside the pool are hidden as keys of another segment: sorted (the fast
    # case) where such pages come last
    hidden = jnp.repeat(~page_ok, page_size, axis=1).astype(jnp.int32)
    q_ids = jnp.zeros(q.shape[:2], jnp.int32)
    exact = jnp.all(hidden[:, 1:] >= hidden[:, :-1], axis=1).astype(jnp.int32)
    runtime = runtime._replace(q_ids=q_ids, kv_ids=hidden, exact=exact)
    return attention_fwd(q, k, v, runtime, layout, scale, soft_cap)[0]


def _unfused(*args, **kwargs):
    raise NotImplementedError("the cuda backend runs the fused attention only")


sddmm = sddmm_bwd = softmax = softmax_bwd = spmm = spmm_bwd = _unfused
