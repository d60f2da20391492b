"""``splat bench-runtime``: splat's runtime masks against their peers, on one GPU.

Two workloads (defaults: bfloat16, H = 16, D = 128, S = 8192), forward and forward+backward:

``doc_causal``
    Packed documents: B = 4 rows of documents of 256..4096 tokens (random
    lengths, seeded; a row's last document is cut at S), causal inside each
    document: ``splat.attention(q, k, v, masks.causal(), segment_ids=ids)``
    with ``ids: [B, S]`` int32, non-decreasing. A NEW packing every call:
    ``packings`` of them are stacked ``[N, B, S]`` and call ``c`` of a timing
    sample uses packing ``c mod N``. A JAX peer's chained program picks it
    with a counter fed from call to call (so no mask is known when the program
    is compiled, and splat's O(B*S) runtime-mask build is inside its time); a
    torch peer copies it into the tensor its ``mask_mod`` reads.
``gemma2_local``
    Gemma 2's local layer: a causal window of ``window`` keys,
    ``masks.sliding_window(window - 1, 0)`` (query ``i`` sees keys
    ``i - window + 1 <= j <= i``), with ``logits_soft_cap``: the scaled scores
    ``z = q.k / sqrt(D)`` become ``cap * tanh(z / cap)``. B = 1.

Peers (each skipped with its reason where it cannot run or cannot express the workload):

=============  =====================================================================================
peer           what
=============  =====================================================================================
splat          ``splat.attention`` with the runtime arguments
flex           FlexAttention's kernel alone: ``mask_mod`` = the static mask's operator form
               (:func:`splat.tools.mask_forms.mask_expression`) ``& (doc[b, q] == doc[b, kv])``;
               one block mask per packing, built before timing; ``score_mod`` = the soft cap
               (Flex hands it the scaled score, as splat caps it)
flex_mask      FlexAttention as a training loop must run it on new packings: the block mask built
               inside every call (``torch.compile(create_block_mask)``) from that call's ids
               (``doc_causal`` only: a static mask is built once, which ``flex`` times)
flash_attn3    FlashAttention-3: ``doc_causal``: ``flash_mha_varlen`` over the B*S tokens
               concatenated, ``cu_seqlens`` of the documents (padded with empty documents to one
               length for all packings), causal; ``gemma2_local``: ``flash_mha`` with the window
               and its ``softcap`` (skipped when its ``flash_mha`` takes none)
cudnn          ``jax.nn.dot_product_attention``: expresses neither workload (reasons in the JSON)
=============  =====================================================================================

Useful FLOPs count the unmasked score entries only (:data:`splat.tools.bench.FLOP_FORMULA`,
with ``B * nnz`` the entries of all rows: for ``doc_causal`` the sum of ``L (L + 1) / 2`` over
the documents, averaged over the packings). Every peer's forward output (on packing 0) is
checked against splat's (:data:`splat.tools.check.CHECK_RULE`). ``metadata`` times
``jax_bindings._runtime.build`` alone on the same packings, chained the same way, as a
fraction of splat's ``doc_causal`` time (target: under 2%).
"""

from __future__ import annotations

import datetime as _dt
import importlib
import inspect
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import numpy as np

from splat.tools import peers as _peers
from splat.tools.bench import (
    FLOP_FORMULA,
    RATIO_DEFINITION,
    backend_unavailable,
    check_peers,
    check_positive_ints,
    environment,
    useful_flops,
)
from splat.tools.check import CHECK_RULE, compare_outputs, short_error
from splat.tools.mask_forms import flash_attn3_arguments, mask_expression
from splat.tools.peers import PeerUnavailable, Prepared
from splat.tools.timing import TIMING_METHOD, compile_timed, on_gpu, sampling, time_call

__all__ = [
    "METADATA_TARGET",
    "RUNTIME_PEERS",
    "WORKLOADS",
    "RuntimeBenchConfig",
    "Workload",
    "cu_seqlens",
    "doc_causal_nnz",
    "format_table",
    "make_workload",
    "pack_documents",
    "run_runtime_bench",
]

SCHEMA = "splat-bench-runtime/1"
WORKLOADS = ("doc_causal", "gemma2_local")
METADATA_TARGET = 0.02  # splat's runtime-mask build, as a fraction of its attention time
_MODES = ("fwd", "fwdbwd", "both")
_DTYPES = ("float32", "bfloat16", "float16")


# --- packed documents ---------------------------------------------------------------------------


def pack_documents(
    rng: np.random.Generator, batch: int, seq_len: int, min_len: int, max_len: int
) -> np.ndarray:
    """Segment ids ``[batch, seq_len]`` int32 of documents packed end to end.

    Each row draws document lengths uniformly from ``[min_len, max_len]`` until
    they fill ``seq_len``; the last one is cut there (so it may be shorter than
    ``min_len``). Ids count documents from 0 in each row (non-decreasing).
    """
    if not 0 < min_len <= max_len:
        raise ValueError(f"document lengths need 0 < min_len <= max_len, got {min_len}, {max_len}")
    ids = np.empty((batch, seq_len), np.int32)
    for b in range(batch):
        start, doc = 0, 0
        while start < seq_len:
            n = int(rng.integers(min_len, max_len + 1))
            ids[b, start : start + n] = doc
            start, doc = start + n, doc + 1
    return ids


def _document_lengths(ids: np.ndarray) -> list[np.ndarray]:
    """Per row of ``ids [B, S]`` (non-decreasing), the lengths of its runs of equal ids."""
    ids = np.asarray(ids)
    if ids.ndim != 2 or (np.diff(ids, axis=1) < 0).any():
        raise ValueError(f"segment ids must be [B, S] and non-decreasing along S, got shape {ids.shape}")
    out = []
    for row in ids:
        starts = np.flatnonzero(np.r_[True, row[1:] != row[:-1]])
        out.append(np.diff(np.r_[starts, row.size]))
    return out


def doc_causal_nnz(ids: np.ndarray) -> int:
    """Unmasked entries of ``causal() & (ids[b, i] == ids[b, j])`` over all rows: sum of ``L (L + 1) / 2``."""
    return int(sum((lens * (lens + 1) // 2).sum() for lens in _document_lengths(ids)))


def cu_seqlens(ids: np.ndarray, num_docs: int | None = None) -> np.ndarray:
    """FlashAttention's ``cu_seqlens`` (int32 ``[num_docs + 1]``) of the rows of ``ids`` concatenated.

    Document boundaries are where the id changes and where a row starts, in the
    ``[B * S]`` token order of ``ids.reshape(-1)``. ``num_docs`` pads with empty
    documents at the end (so packings share one shape).
    """
    lens = np.concatenate(_document_lengths(ids))
    n = len(lens) if num_docs is None else num_docs
    if n < len(lens):
        raise ValueError(f"num_docs {n} is fewer than the {len(lens)} documents")
    out = np.full(n + 1, np.asarray(ids).size, np.int32)
    out[: len(lens) + 1] = np.r_[0, np.cumsum(lens)]
    return out


# --- settings and workloads ---------------------------------------------------------------------


@dataclass(frozen=True)
class RuntimeBenchConfig:
    """Settings of one ``splat bench-runtime`` run (every field lands in the JSON).

    Attributes:
      workloads: names in :data:`WORKLOADS`.
      mode: "fwd", "fwdbwd" or "both".
      seq_len: S (queries = keys).
      batch: B of ``doc_causal``; local_batch: B of ``gemma2_local``.
      heads, head_dim: H, D of ``q, k, v: [B, S, H, D]``.
      dtype: "bfloat16", "float16" or "float32".
      doc_min, doc_max: document lengths drawn (``doc_causal``).
      packings: N different packings cycled through while timing.
      window, soft_cap: ``gemma2_local``'s window (keys, the query's own included) and logit cap.
      peers: names in :data:`RUNTIME_PEERS` (splat always runs); None = all.
      backend: splat's backend.
      warmup, repeats: untimed and timed samples after the first (compiling) run.
      seed: seed of the inputs and the packings.
    """

    workloads: tuple[str, ...] = WORKLOADS
    mode: str = "both"
    seq_len: int = 8192
    batch: int = 4
    local_batch: int = 1
    heads: int = 16
    head_dim: int = 128
    dtype: str = "bfloat16"
    doc_min: int = 256
    doc_max: int = 4096
    packings: int = 10
    window: int = 4096
    soft_cap: float = 50.0
    peers: tuple[str, ...] | None = None
    backend: str = "auto"
    warmup: int = 3
    repeats: int = 10
    seed: int = 0

    def __post_init__(self):
        if self.mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {self.mode!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        bad = [w for w in self.workloads if w not in WORKLOADS] or (not self.workloads and ["(none)"])
        if bad:
            raise ValueError(f"unknown workload(s) {bad}; known: {', '.join(WORKLOADS)}")
        check_positive_ints(
            self, "seq_len batch local_batch heads head_dim doc_min doc_max packings window repeats".split()
        )
        if self.doc_min > self.doc_max:
            raise ValueError(f"doc_min {self.doc_min} must not exceed doc_max {self.doc_max}")
        if not self.soft_cap > 0:
            raise ValueError(f"soft_cap must be positive, got {self.soft_cap!r}")
        check_peers(self.peers, RUNTIME_PEERS)

    @property
    def modes(self) -> tuple[str, ...]:
        return ("fwd", "fwdbwd") if self.mode == "both" else (self.mode,)

    @classmethod
    def quick(cls, **kw) -> RuntimeBenchConfig:
        """Small sizes and few repeats: a set-up check, not a measurement."""
        small = dict(seq_len=2048, doc_min=128, doc_max=1024, packings=4, window=1024, warmup=1, repeats=3)
        return cls(**{**small, **kw})


@dataclass(frozen=True, eq=False)
class Workload:
    """One workload in one mode: the same inputs for every peer.

    Attributes:
      name: a name in :data:`WORKLOADS`.
      q, k, v, do: float32 numpy ``[B, S, H, D]``; peers cast them to ``dtype``.
      dtype, mode: as in :class:`splat.tools.peers.Problem`.
      mask: the static :class:`splat.masks.Mask` (the runtime ids are AND-ed with it).
      nnz: unmasked score entries of one call, all batch rows (mean over the packings).
      packings: int32 ``[N, B, S]`` segment ids, call ``c`` uses ``packings[c % N]``; None: none.
      soft_cap: the logit soft cap, or None.
      backend: splat's backend.
      per_sample: calls a JAX peer chains into one executable.
    """

    name: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray
    dtype: str
    mode: str
    mask: object
    nnz: float
    packings: np.ndarray | None = None
    soft_cap: float | None = None
    backend: str = "auto"
    per_sample: int = 1

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def seq_len(self) -> int:
        return self.q.shape[1]


def make_workload(config: RuntimeBenchConfig, name: str, per_sample: int = 1) -> tuple[Workload, str]:
    """``(workload, description)`` of ``name`` under ``config``, in its first mode (``replace`` sets
    another); inputs and packings come from ``config.seed``."""
    import splat
    from splat import masks

    s, h, d = config.seq_len, config.heads, config.head_dim
    rng = np.random.default_rng(config.seed)
    b = config.batch if name == "doc_causal" else config.local_batch
    q, k, v, do = (rng.standard_normal((b, s, h, d), dtype=np.float32) for _ in range(4))
    common = dict(dtype=config.dtype, mode=config.modes[0], backend=config.backend, per_sample=per_sample)
    if name == "doc_causal":
        packs = np.stack(
            [pack_documents(rng, b, s, config.doc_min, config.doc_max) for _ in range(config.packings)]
        )
        nnz = float(np.mean([doc_causal_nnz(p) for p in packs]))
        docs = np.mean([len(np.concatenate(_document_lengths(p))) / b for p in packs])
        what = (
            f"causal() & same document: B={b}, S={s}, documents of {config.doc_min}..{config.doc_max} "
            f"tokens ({docs:.1f} per row on average), {config.packings} packings cycled (call c uses "
            f"packing c mod {config.packings}), segment_ids new every call"
        )
        return Workload(name, q, k, v, do, mask=masks.causal(), nnz=nnz, packings=packs, **common), what
    mask = masks.sliding_window(config.window - 1, 0)
    nnz = float(b * splat.analyze(mask, q_len=s, kv_len=s).nnz)
    what = (
        f"Gemma 2 local layer: {mask!r} (keys i-{config.window - 1}..i) with "
        f"logits_soft_cap={config.soft_cap}: B={b}, S={s}"
    )
    return Workload(name, q, k, v, do, mask=mask, nnz=nnz, soft_cap=config.soft_cap, **common), what


# --- JAX programs -------------------------------------------------------------------------------


def _program(attn: Callable, w: Workload, stacks: tuple = ()) -> tuple[Callable, tuple, dict]:
    """``(fn, args, feed)`` for :func:`splat.tools.timing.compile_timed`.

    ``fn`` makes one call ``attn(q, k, v, *picked)`` (with its VJP in fwdbwd
    mode), ``picked`` being entry ``step % N`` of each ``[N, ...]`` array in
    ``stacks``; it returns ``step + 1`` last, and ``feed`` hands that to the next
    chained call (with ``out`` as its ``q`` and, in fwdbwd mode, ``dq`` as its ``do``).
    ``args`` end with ``step = 0``: a single call uses entry 0.
    """
    import jax
    import jax.numpy as jnp

    dt = _peers.jax_dtype(w.dtype)
    q, k, v, do = (jnp.asarray(a, dt) for a in (w.q, w.k, w.v, w.do))
    stacks = tuple(jnp.asarray(s) for s in stacks)
    n, ns = (stacks[0].shape[0] if stacks else 1), len(stacks)
    step = jnp.zeros((), jnp.int32)

    def pick(rest):
        i = rest[ns] % n
        return tuple(jax.lax.dynamic_index_in_dim(s, i, keepdims=False) for s in rest[:ns])

    if w.mode == "fwd":

        def fwd(q, k, v, *rest):
            return attn(q, k, v, *pick(rest)), rest[ns] + 1

        return fwd, (q, k, v, *stacks, step), {0: 0, 3 + ns: 1}  # leaves: out, step

    def fwdbwd(q, k, v, do, *rest):
        picked = pick(rest)
        out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, *picked), q, k, v)
        return out, vjp(do), rest[ns] + 1

    return fwdbwd, (q, k, v, do, *stacks, step), {0: 0, 3: 1, 4 + ns: 4}  # leaves: out, dq, dk, dv, step


def _jax_prepared(attn: Callable, w: Workload, stacks: tuple = (), note: str = "", **kw) -> Prepared:
    """Compiles :func:`_program`; ``outputs()`` is one call on entry 0 of the stacks."""
    import jax

    fn, args, feed = _program(attn, w, stacks)
    compiled, launch, sync = compile_timed(fn, args, w.per_sample, feed)
    mem = compiled.memory_analysis()

    def outputs():
        res = jax.block_until_ready(compiled(*args))
        return res[0] if w.mode == "fwd" else (res[0], res[1])

    def run():
        outputs()

    temp = None if mem is None else int(mem.temp_size_in_bytes)
    return Prepared(run, temp, note, outputs, launch, sync, w.per_sample, **kw)


# --- peers ----------------------------------------------------------------------------------------


def _splat_backend(w: Workload) -> str:
    """The backend ``splat.attention`` picks for this workload (``"unknown (...)"`` where it cannot say)."""
    import jax
    import jax.numpy as jnp

    import splat

    s = w.seq_len
    x = jax.ShapeDtypeStruct(w.q.shape, _peers.jax_dtype(w.dtype))
    kw = {} if w.soft_cap is None else {"soft_cap": w.soft_cap}
    if w.packings is not None:
        try:
            from jax_bindings import _runtime

            ids = jax.ShapeDtypeStruct(w.packings.shape[1:], jnp.int32)
            kw["runtime"] = jax.eval_shape(lambda i: _runtime.build(w.batch, s, s, segment_ids=i), ids)
        except Exception as e:  # a record of what ran must not stop the run
            return f"unknown ({short_error(e)})"
    layout = splat.analyze(w.mask, q_len=s, kv_len=s)
    return _peers.splat_backend("attention", x, x, x, layout, w.q.shape[-1] ** -0.5, backend=w.backend, **kw)


def _prep_splat(w: Workload) -> Prepared:
    import splat

    mask, backend = w.mask, w.backend
    kw = {} if w.soft_cap is None else {"logits_soft_cap": w.soft_cap}
    params = inspect.signature(splat.attention).parameters
    missing = [n for n in (*kw, *(["segment_ids"] if w.packings is not None else [])) if n not in params]
    if missing:
        raise PeerUnavailable(f"splat.attention takes no {', '.join(missing)} in this build")
    if w.packings is None:
        stacks = ()

        def attn(q, k, v):
            return splat.attention(q, k, v, mask, backend=backend, **kw)
    else:
        stacks = (w.packings,)

        def attn(q, k, v, ids):
            return splat.attention(q, k, v, mask, segment_ids=ids, backend=backend, **kw)

    return _jax_prepared(attn, w, stacks, splat_backend=_splat_backend(w))


def _flex(w: Workload, mask_per_call: bool) -> Prepared:
    torch = _peers._torch_cuda()
    try:
        fa = importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError as e:
        raise PeerUnavailable(f"this torch has no FlexAttention ({e})") from None
    if mask_per_call and w.packings is None:
        raise PeerUnavailable("the mask is static: a training loop builds its block mask once (row 'flex')")
    expr = mask_expression(w.mask)
    if expr is None:
        raise PeerUnavailable(f"{w.mask!r} has no operator form for a mask_mod")
    s, cap = w.seq_len, w.soft_cap
    if w.packings is None:
        stack = doc = None
        n, rows = 1, None

        def mask_mod(b, h, q_idx, kv_idx):
            return expr(q_idx, kv_idx)
    else:
        stack = torch.from_numpy(w.packings).to("cuda")
        doc = stack[0].clone()  # the ids mask_mod reads: the current call's packing is copied in
        n, rows = len(stack), w.batch

        def mask_mod(b, h, q_idx, kv_idx):
            return expr(q_idx, kv_idx) & (doc[b, q_idx] == doc[b, kv_idx])

    score_mod = None
    if cap is not None:

        def score_mod(score, b, h, q_idx, kv_idx):  # Flex's score is already q.k * scale
            return cap * torch.tanh(score / cap)

    create = torch.compile(fa.create_block_mask)

    def block_mask():
        return create(mask_mod, rows, None, s, s, device="cuda")

    built = []
    for i in range(0 if mask_per_call else n):
        if doc is not None:
            doc.copy_(stack[i])
        built.append(block_mask())
    flex = _peers.compiled_flex(torch, fa)
    calls = [0]

    def attn(q, k, v):
        i = calls[0] % n
        calls[0] += 1
        if doc is not None:
            doc.copy_(stack[i])
        return flex(q, k, v, score_mod=score_mod, block_mask=block_mask() if mask_per_call else built[i])

    note = "create_block_mask (torch.compile'd) in every call" if mask_per_call else "block masks built once"
    prepared = _peers._torch_prepared(torch, attn, w, note)
    first = prepared.outputs

    def outputs():  # packing 0, as the JAX peers' single call
        calls[0] = 0
        return first()

    return replace(prepared, outputs=outputs)


def _prep_flex(w: Workload) -> Prepared:
    return _flex(w, mask_per_call=False)


def _prep_flex_mask(w: Workload) -> Prepared:
    return _flex(w, mask_per_call=True)


def _prep_flash_attn3(w: Workload) -> Prepared:
    try:
        fa3 = importlib.import_module("flash_attn3_jax")
    except ImportError as e:
        raise PeerUnavailable(f"flash_attn3_jax is not installed ({e})") from None
    if not _peers._hopper():
        raise PeerUnavailable("FlashAttention-3 needs an NVIDIA Hopper GPU (compute capability 9.x)")
    if w.dtype == "float32":
        raise PeerUnavailable("FlashAttention-3 takes float16/bfloat16 only")
    d = w.q.shape[-1]
    if d not in _peers.FLASH_ATTN3_HEAD_DIMS:
        raise PeerUnavailable(f"FlashAttention-3 runs head dim {_peers.FLASH_ATTN3_HEAD_DIMS} only, not {d}")
    import splat

    s = w.seq_len
    kw = flash_attn3_arguments(splat.analyze(w.mask, q_len=s, kv_len=s))
    if kw is None:
        raise PeerUnavailable(f"FlashAttention-3 cannot express {w.mask!r}")
    kw["softmax_scale"] = d**-0.5
    if w.packings is None:
        if w.soft_cap is not None:
            if not _peers.takes_keyword(fa3.flash_mha, "softcap"):
                raise PeerUnavailable("this flash_attn3_jax.flash_mha takes no softcap")
            kw["softcap"] = w.soft_cap

        def attn(q, k, v):
            return fa3.flash_mha(q, k, v, **kw)

        return _jax_prepared(attn, w, note=f"flash_mha({', '.join(f'{a}={b}' for a, b in kw.items())})")
    varlen = getattr(fa3, "flash_mha_varlen", None)
    if varlen is None:
        raise PeerUnavailable("this flash_attn3_jax has no flash_mha_varlen")
    if w.soft_cap is not None:
        raise PeerUnavailable("no soft cap with flash_mha_varlen here")
    num_docs = max(len(cu_seqlens(p)) - 1 for p in w.packings)
    cus = np.stack([cu_seqlens(p, num_docs) for p in w.packings])  # [N, num_docs + 1]
    longest = int(max(np.diff(c).max() for c in cus))
    causal, window = kw["is_causal"], kw["window_size"]
    if window != (-1, -1) and window != (-1, 0):
        raise PeerUnavailable(f"only plain or causal documents here, not window {window}")

    def attn(q, k, v, cu):
        b, s, h, d = q.shape
        flat = [x.reshape(b * s, x.shape[2], d) for x in (q, k, v)]
        out = varlen(
            *flat, cu, cu, max_seqlen_q=longest, max_seqlen_k=longest, softmax_scale=d**-0.5, is_causal=causal
        )
        return out.reshape(b, s, h, d)

    note = f"flash_mha_varlen, {num_docs} documents (empty ones pad), max_seqlen {longest}, causal={causal}"
    return _jax_prepared(attn, w, (cus,), note)


def _prep_cudnn(w: Workload) -> Prepared:
    if w.packings is not None:
        raise PeerUnavailable(
            "jax.nn.dot_product_attention takes per-row lengths, not segment ids: packed documents "
            "would need a dense [B, 1, S, S] mask"
        )
    if w.soft_cap is not None:
        raise PeerUnavailable("jax.nn.dot_product_attention has no logit soft cap")
    raise PeerUnavailable("only the runtime workloads here; static masks: splat bench")


@dataclass(frozen=True)
class RuntimePeer:
    name: str
    description: str
    prepare: Callable[[Workload], Prepared]


RUNTIME_PEERS: dict[str, RuntimePeer] = {
    p.name: p
    for p in (
        RuntimePeer("splat", "splat.attention with segment_ids / logits_soft_cap", _prep_splat),
        RuntimePeer("flex", "FlexAttention kernel, block masks built before timing", _prep_flex),
        RuntimePeer("flex_mask", "FlexAttention with create_block_mask inside every call", _prep_flex_mask),
        RuntimePeer("flash_attn3", "FlashAttention-3: flash_mha_varlen / flash_mha", _prep_flash_attn3),
        RuntimePeer("cudnn", "jax.nn.dot_product_attention(implementation='cudnn')", _prep_cudnn),
    )
}


# --- metadata ------------------------------------------------------------------------------------


def _metadata_timing(w: Workload, warmup: int, repeats: int, min_sample_ms: float) -> dict:
    """Times ``jax_bindings._runtime.build`` alone on the packings, chained as splat's calls are."""
    import jax
    import jax.numpy as jnp

    try:
        from jax_bindings import _runtime
    except ImportError as e:
        raise PeerUnavailable(f"jax_bindings._runtime is not in this build ({e})") from None
    b, s = w.batch, w.seq_len
    n = len(w.packings)

    def build(stack, step):
        ids = jax.lax.dynamic_index_in_dim(stack, step % n, keepdims=False)
        return step + 1, _runtime.build(b, s, s, segment_ids=ids)

    args = (jnp.asarray(w.packings), jnp.zeros((), jnp.int32))
    _, launch, sync = compile_timed(build, args, w.per_sample, {1: 0})
    return time_call(
        None,
        warmup,
        repeats,
        launch=launch,
        sync=sync,
        per_sample=w.per_sample,
        calls_per_launch=w.per_sample,
        min_sample_ms=min_sample_ms,
    )


# --- the run -------------------------------------------------------------------------------------


def _verdict(out, ref, dtype: str, why_none: str) -> dict:
    if ref is None:
        return {
            "max_abs_err_vs_splat": None,
            "rel_err_vs_splat": None,
            "check_tolerance": None,
            "agrees": None,
            "check": why_none,
        }
    return compare_outputs(out, ref, dtype)


def run_runtime_bench(
    config: RuntimeBenchConfig, log: Callable[[str], None] = print, allow_cpu: bool = False
) -> dict:
    """Runs the benchmark; returns the JSON-ready result (see the module docstring).

    Args:
      config: the settings.
      log: where progress and the table go.
      allow_cpu: run without a GPU (tests, at tiny sizes); by default a CPU is refused.

    Returns:
      ``{"schema", "created", "environment", "settings", "workloads", "flop_formula",
      "ratio_definition", "timing_method", "check_rule", "results", "skipped",
      "disagreements", "metadata"}``. Rows carry ``workload`` (also as ``pattern``, for
      :func:`splat.tools.plot.plot_bench`), ``S``, ``batch``, ``mode``, ``impl``, ``nnz``,
      the timing (``ms`` ...), ``tflops``, ``vs_splat`` and the output check.

    Raises:
      ValueError: no GPU (unless ``allow_cpu``), or a splat backend that cannot run here.
    """
    if not allow_cpu and not on_gpu():
        raise ValueError(
            "bench-runtime times GPU workloads (S=8192, H=16, D=128, bf16) against GPU peers and "
            "needs a GPU; JAX sees none here"
        )
    reason = backend_unavailable(config.backend)
    if reason is not None:
        raise ValueError(f"splat backend {config.backend!r} cannot run here: {reason}")
    env = environment()
    per_sample, min_sample_ms = sampling()
    names = ["splat"] + [p for p in (config.peers or RUNTIME_PEERS) if p != "splat"]
    log(f"splat bench-runtime on {env['device']} ({env['platform']}); {FLOP_FORMULA}; {RATIO_DEFINITION}")
    results, skipped, disagreements, described = [], [], [], {}
    metadata: dict = {"target_fraction": METADATA_TARGET}
    h, d = config.heads, config.head_dim
    for wname in config.workloads:
        ref, verdicts, splat_ms = None, {}, {}
        first, described[wname] = make_workload(config, wname, per_sample)
        for mode in config.modes:
            w = replace(first, mode=mode)
            flops = useful_flops(1, h, w.nnz, d, mode)  # nnz counts all batch rows
            base = {
                "workload": wname,
                "pattern": wname,
                "S": w.seq_len,
                "batch": w.batch,
                "mode": mode,
                "nnz": w.nnz,
                "density": w.nnz / (w.batch * w.seq_len**2),
            }
            rows = {}
            for peer in names:
                try:
                    prepared = RUNTIME_PEERS[peer].prepare(w)
                    if peer not in verdicts:  # forward output on packing 0, once per peer
                        got = prepared.outputs()
                        out = np.asarray(got if mode == "fwd" else got[0], np.float32)
                        if peer == "splat":
                            ref = out
                        verdicts[peer] = _verdict(out, ref, w.dtype, "splat did not run")
                        del got, out
                    t = prepared.time(config.warmup, config.repeats, per_sample, min_sample_ms)
                except Exception as e:  # unavailable, or crashed: record why and go on
                    why = str(e) if isinstance(e, PeerUnavailable) else f"error: {short_error(e)}"
                    skipped.append({**base, "impl": peer, "reason": why})
                    log(f"  skip {peer} ({wname}, {mode}): {why}")
                    continue
                v = verdicts[peer]
                row = {
                    **base,
                    "impl": peer,
                    **t,
                    "tflops": flops / (t["ms"] * 1e-3) / 1e12,
                    "temp_bytes": prepared.temp_bytes,
                    "note": prepared.note,
                    "splat_backend": prepared.splat_backend,
                    **v,
                }
                if v["agrees"] is False:
                    disagreements.append({**base, "impl": peer, **v})
                    log(f"  !!! WARNING: {peer} DISAGREES WITH SPLAT on {wname}: {v}")
                rows[peer] = row
                results.append(row)
                log(f"  {peer:12s} {wname} {mode}: {t['ms']:.3f} ms")
            if "splat" in rows:
                splat_ms[mode] = rows["splat"]["ms"]
            for row in rows.values():
                row["vs_splat"] = row["ms"] / splat_ms[mode] if mode in splat_ms else None
        if wname == "doc_causal":
            try:
                t = _metadata_timing(w, config.warmup, config.repeats, min_sample_ms)
            except Exception as e:
                metadata["skipped"] = str(e) if isinstance(e, PeerUnavailable) else f"error: {short_error(e)}"
                log(f"  skip metadata: {metadata['skipped']}")
                continue
            frac = {m: t["ms"] / ms for m, ms in splat_ms.items()}
            metadata.update(
                {
                    "what": "jax_bindings._runtime.build(B, S, S, segment_ids=ids) alone on the packings",
                    **t,
                    "fraction_of_splat": frac,
                    "meets_target": all(f < METADATA_TARGET for f in frac.values()) if frac else None,
                }
            )
    out = {
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "environment": env,
        "settings": {
            **asdict(config),
            "peers": names,
            "per_sample": per_sample,
            "min_sample_ms": min_sample_ms,
        },
        "workloads": described,
        "flop_formula": FLOP_FORMULA + "; B*nnz = unmasked entries of all batch rows (mean over packings)",
        "ratio_definition": RATIO_DEFINITION,
        "timing_method": TIMING_METHOD,
        "check_rule": CHECK_RULE + " (packing 0)",
        "results": results,
        "skipped": skipped,
        "disagreements": disagreements,
        "metadata": metadata,
    }
    log(format_table(out))
    return out


def format_table(result: dict) -> str:
    """The results as a short text table, then skips and the metadata cost."""
    hdr = f"{'workload':14s} {'mode':6s} {'impl':12s} {'ms':>9s} {'TFLOP/s':>8s} {'x splat':>8s} check  note"
    lines = [result["flop_formula"], result["ratio_definition"], "", hdr, "-" * len(hdr)]
    for r in result["results"]:
        ratio = "-" if r.get("vs_splat") is None else f"{r['vs_splat']:.2f}"
        chk = {True: "ok", False: "DIFF"}.get(r.get("agrees"), "-")
        note = "; ".join(
            x for x in (r.get("splat_backend") and f"backend {r['splat_backend']}", r["note"]) if x
        )
        lines.append(
            f"{r['workload']:14s} {r['mode']:6s} {r['impl']:12s} {r['ms']:9.3f} {r['tflops']:8.2f} "
            f"{ratio:>8s} {chk:>5s}  {note}"
        )
    if result["skipped"]:
        lines += ["", "skipped:"]
        for s in result["skipped"]:
            lines.append(f"  {s['impl']:12s} {s['workload']:14s} {s['mode']:6s} {s['reason']}")
    md = result["metadata"]
    if "fraction_of_splat" in md:
        fr = ", ".join(f"{m} {f:.2%}" for m, f in md["fraction_of_splat"].items()) or "no splat time"
        ok = {True: "meets", False: "MISSES", None: "cannot judge"}[md["meets_target"]]
        target = f"{md['target_fraction']:.0%}"
        lines += [
            "",
            f"runtime-mask build alone: {md['ms']:.4f} ms = {fr} of splat's ({ok} the {target} target)",
        ]
    elif "skipped" in md:
        lines += ["", f"runtime-mask build not timed: {md['skipped']}"]
    return "\n".join(lines)
