"""The implementations ``splat bench`` times splat against, all in one process.

Each peer turns a :class:`Problem` into a :class:`Prepared` run: a zero-argument
callable that computes the attention (forward, or forward + backward) and waits
for the device, plus XLA's temp-memory figure where the peer is a JAX program.
For timing, a JAX peer also compiles ``Problem.per_sample`` calls chained into one
executable (:func:`splat.tools.timing.chain`), so no host dispatch falls between
them, as attention inside a jitted training step; torch peers launch their calls
one by one. Peers that take only some masks recognise them from the layout
(:mod:`splat.tools.mask_forms`).
Peers import their libraries lazily; one that cannot run here raises
:class:`PeerUnavailable` with the reason, which the benchmark prints.
``Prepared.outputs()`` returns what a run computes, so the benchmark can check
each peer's output against splat's on the same inputs (all but ``torch_sdpa``,
which runs with no mask by design: ``Peer.no_check`` says so).

==============  ========  ===========================================================
peer            runs on   what
==============  ========  ===========================================================
splat           all       ``splat.attention`` (the fused kernels on CUDA)
splat_unfused   all       ``splat.sddmm`` -> ``splat.softmax`` -> ``splat.spmm``
dense_xla       all       einsum + where + softmax under ``jax.jit`` (S x S scores)
cudnn           CUDA      ``jax.nn.dot_product_attention(implementation="cudnn")``;
                          full, causal and causal-window masks only
cudnn_dense     CUDA      the same call with the mask as a dense ``[1, 1, S, S]``
                          array, any mask: dense attention (all S x S scores), the
                          reference a JAX user without a sparse kernel has
flash_attn3     Hopper    FlashAttention-3, ``flash_attn3_jax.flash_mha``; full,
                          causal, causal-window and (left, right) window masks,
                          head dim 128, float16/bfloat16
tokamax         CUDA      ``tokamax.dot_product_attention``; windows as
                          ``local_window_size``, other masks as a dense mask array
flex            CUDA      PyTorch FlexAttention, ``torch.compile``d, with a
                          ``mask_mod`` translated from the splat mask (a
                          neighborhood's computed from the flattened indices)
torch_sdpa      CUDA      dense torch SDPA (flash/efficient) with no mask at all:
                          the dense ceiling
==============  ========  ===========================================================
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from splat.tools.mask_forms import band_of, flash_attn3_arguments, mask_expression
from splat.tools.timing import Sampler, compile_timed

__all__ = [
    "FLASH_ATTN3_HEAD_DIMS",
    "PEERS",
    "Peer",
    "PeerUnavailable",
    "Prepared",
    "Problem",
    "compiled_flex",
    "jax_dtype",
    "splat_backend",
]

# A dense [S, S] mask array is built for a peer only up to this many elements.
_MAX_DENSE_MASK = 1 << 28


class PeerUnavailable(Exception):
    """This peer cannot run this problem here; ``str(e)`` says why."""


@dataclass(frozen=True, eq=False)
class Problem:
    """One benchmark problem: the same inputs for every peer.

    Attributes:
      q, k, v: float32 numpy ``[B, S, H, D]`` master copies; peers cast them to ``dtype``.
      do: float32 numpy ``[B, S, H, D]`` output cotangent for the backward pass.
      mask: the :class:`splat.masks.Mask`.
      layout: its :class:`acsr.ACSR` for ``S x S``.
      dtype: "float32", "bfloat16" or "float16".
      mode: "fwd" or "fwdbwd".
      backend: splat's backend, one of ``jax_bindings.BACKENDS``.
      per_sample: the fewest calls a timing sample makes; a JAX peer compiles that
        many chained calls into the one executable its ``launch()`` runs.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray
    mask: object
    layout: object
    dtype: str
    mode: str
    backend: str = "auto"
    per_sample: int = 1
    _dense: list = field(default_factory=list, repr=False)

    @property
    def seq_len(self) -> int:
        return self.q.shape[1]

    def dense_mask(self) -> np.ndarray:
        """The mask as a bool ``[S, S]`` numpy array (built once, only where small enough)."""
        s = self.seq_len
        if s * s > _MAX_DENSE_MASK:
            raise PeerUnavailable(f"needs a dense {s}x{s} mask array (over {_MAX_DENSE_MASK} elements)")
        if not self._dense:
            self._dense.append(self.layout.to_dense())
        return self._dense[0]


@dataclass(frozen=True)
class Prepared:
    """A compiled run: ``run()`` computes and blocks until the device is done.

    ``outputs()`` returns what one run computes: ``out [B, S, H, D]`` in fwd
    mode, ``(out, (dq, dk, dv))`` in fwdbwd mode (jax arrays for JAX peers,
    float32 numpy ``[B, S, H, D]`` for torch peers). The tests check it against
    a float64 reference; ``splat bench`` compares every peer's ``out`` with
    splat's.
    """

    run: Callable[[], None]
    temp_bytes: int | None = None
    note: str = ""
    outputs: Callable[[], object] | None = None
    # enqueue calls without waiting, and wait for everything enqueued: a timing sample
    # is launches back to back and one sync, so sync latency is not charged to each
    # call. A JAX peer's launch() runs Problem.per_sample calls chained in one executable
    # (calls_per_launch: no host dispatch between them); a torch peer's makes one call
    launch: Callable[[], None] | None = None
    sync: Callable[[], None] | None = None
    calls_per_launch: int = 1
    # splat's own peers: the jax_bindings backend that ran (splat_backend()); None for other peers
    splat_backend: str | None = None

    def sampler(self, per_sample: int, min_sample_ms: float) -> Sampler:
        """A :class:`splat.tools.timing.Sampler` of this run: its launches and syncs when it has them."""
        return Sampler(
            self.run,
            launch=self.launch,
            sync=self.sync,
            per_sample=per_sample,
            calls_per_launch=self.calls_per_launch,
            min_sample_ms=min_sample_ms,
        )

    def time(self, warmup: int, repeats: int, per_sample: int, min_sample_ms: float) -> dict:
        """:func:`splat.tools.timing.time_call` of this run, alone (see :meth:`sampler`)."""
        return self.sampler(per_sample, min_sample_ms).alone(warmup, repeats)


@dataclass(frozen=True)
class Peer:
    """A named implementation; ``prepare(problem)`` returns :class:`Prepared` or raises PeerUnavailable.

    ``no_check``: why this peer's output is *not* compared with splat's (it
    computes something else by design); empty for peers that must agree.
    """

    name: str
    description: str
    prepare: Callable[[Problem], Prepared]
    gpu_only: bool = False
    no_check: str = ""


# --- helpers -------------------------------------------------------------------------


def _on_cuda() -> bool:
    import jax

    if jax.default_backend() != "gpu":
        return False
    dev = jax.devices()[0]
    try:
        return "cuda" in dev.client.platform_version.lower()
    except Exception:  # older clients: fall back on the device name
        return "nvidia" in dev.device_kind.lower()


def jax_dtype(name: str):
    """The jnp dtype called ``name`` ("float32", "bfloat16" or "float16")."""
    import jax.numpy as jnp

    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


def splat_backend(op: str, *args, backend: str = "auto", **kwargs) -> str:
    """The jax_bindings backend that runs ``op`` on ``args`` (``"unknown"`` where it cannot say).

    Asks ``jax_bindings.selected_backend(op, *args, backend=backend, **kwargs)`` where
    that function exists; ``args`` are what the op takes (abstract arrays do), ``kwargs``
    its keyword arguments (``runtime``, ``soft_cap``).
    """
    import jax_bindings

    select = getattr(jax_bindings, "selected_backend", None)
    if select is None:
        return "unknown"
    try:
        return str(select(op, *args, backend=backend, **kwargs))
    except Exception as e:  # a record of what ran must not stop the run; say why it is missing
        msg = str(e).strip().splitlines()
        return f"unknown ({type(e).__name__}: {msg[0][:120] if msg else ''})"


def _abstract(problem: Problem):
    """An abstract ``[B, S, H, D]`` array of the problem's dtype."""
    import jax

    return jax.ShapeDtypeStruct(problem.q.shape, jax_dtype(problem.dtype))


def _jax_program(attn: Callable, problem: Problem, extra_args: tuple = ()) -> tuple[Callable, tuple, dict]:
    """``(fn, args, feed)``: ``attn(q, k, v, *extra_args)`` (with its VJP in fwdbwd mode) on the inputs.

    ``feed`` (see :func:`splat.tools.timing.chain`) chains calls as stacked layers would: ``out`` is
    the next call's ``q``, and in fwdbwd mode ``dq`` its output cotangent ``do``.
    """
    import jax
    import jax.numpy as jnp

    dt = jax_dtype(problem.dtype)
    q, k, v, do = (jnp.asarray(a, dt) for a in (problem.q, problem.k, problem.v, problem.do))
    extra = tuple(jnp.asarray(a) for a in extra_args)
    if problem.mode == "fwd":
        return attn, (q, k, v, *extra), {0: 0}

    def fn(q, k, v, do, *extra):
        out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, *extra), q, k, v)
        return out, vjp(do)

    return fn, (q, k, v, do, *extra), {0: 0, 3: 1}  # leaves: out, dq, dk, dv


def _compile_jax(attn: Callable, problem: Problem, extra_args: tuple = ()) -> Prepared:
    """jit + lower + compile ``attn(q, k, v, *extra_args)`` (with its VJP in fwdbwd mode).

    ``run()``/``outputs()`` make one call; ``launch()`` makes ``problem.per_sample``
    chained calls in one executable (:func:`compile_timed`).
    """
    import jax

    fn, args, feed = _jax_program(attn, problem, extra_args)
    compiled, launch, sync = compile_timed(fn, args, problem.per_sample, feed)
    mem = compiled.memory_analysis()
    temp = None if mem is None else int(mem.temp_size_in_bytes)

    def outputs():
        return jax.block_until_ready(compiled(*args))

    def run():
        outputs()

    return Prepared(run, temp, outputs=outputs, launch=launch, sync=sync, calls_per_launch=problem.per_sample)


# --- JAX peers ---------------------------------------------------------------------------


def _prep_splat(problem: Problem) -> Prepared:
    import splat

    if not hasattr(splat, "attention"):
        raise PeerUnavailable("splat.attention is not available in this build")
    mask, backend = problem.mask, problem.backend
    x = _abstract(problem)
    return replace(
        _compile_jax(lambda q, k, v: splat.attention(q, k, v, mask=mask, backend=backend), problem),
        splat_backend=splat_backend(
            "attention", x, x, x, problem.layout, x.shape[-1] ** -0.5, backend=backend
        ),
    )


def _prep_splat_triton(problem: Problem) -> Prepared:
    """splat's Triton kernels named explicitly: beside ``splat`` on another backend, in the same run."""
    if problem.backend == "triton":
        raise PeerUnavailable("splat itself runs on the triton backend here (see the splat row)")
    return _prep_splat(replace(problem, backend="triton"))


def _prep_splat_unfused(problem: Problem) -> Prepared:
    import splat

    if not all(hasattr(splat, n) for n in ("sddmm", "softmax", "spmm")):
        raise PeerUnavailable("splat.sddmm/softmax/spmm are not available in this build")
    layout, backend = problem.layout, problem.backend

    def attn(q, k, v):
        s = splat.sddmm(q, k, layout, backend=backend)
        p = splat.softmax(s, layout, scale=q.shape[-1] ** -0.5, backend=backend)
        return splat.spmm(p, v, layout, backend=backend)

    x = _abstract(problem)  # recorded: the backend of the first op, sddmm
    return replace(
        _compile_jax(attn, problem), splat_backend=splat_backend("sddmm", x, x, layout, backend=backend)
    )


def _dense_attention(q, k, v, mask):
    """Masked softmax attention through the full ``[B, H, S, S]`` scores; fully masked rows give 0."""
    import jax
    import jax.numpy as jnp

    scale = q.shape[-1] ** -0.5
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask, s, jnp.finfo(jnp.float32).min)
    p = jnp.where(mask, jax.nn.softmax(s, axis=-1), 0.0)  # fully masked rows -> 0
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v)


def _prep_dense_xla(problem: Problem) -> Prepared:
    return _compile_jax(_dense_attention, problem, (problem.dense_mask(),))


def _prep_cudnn(problem: Problem) -> Prepared:
    import jax

    if not _on_cuda():
        raise PeerUnavailable("cuDNN attention needs a CUDA GPU")
    if problem.dtype == "float32":
        raise PeerUnavailable("cuDNN flash attention takes float16/bfloat16 only (use --dtype bfloat16)")
    s = problem.seq_len
    band = band_of(problem.layout)
    if band is None:
        raise PeerUnavailable("cuDNN takes only full, causal or causal-window masks; this mask is none")
    left, right = band
    if (left, right) == (s - 1, s - 1):
        kw = {}
    elif right == 0:
        kw = {"is_causal": True} if left == s - 1 else {"is_causal": True, "local_window_size": (left, 0)}
    else:
        raise PeerUnavailable(
            f"cuDNN supports only causal windows (right = 0); this window is ({left}, {right})"
        )

    def attn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kw)

    return _compile_jax(attn, problem)


def _prep_cudnn_dense(problem: Problem) -> Prepared:
    import jax

    if not _on_cuda():
        raise PeerUnavailable("cuDNN attention needs a CUDA GPU")
    if problem.dtype == "float32":
        raise PeerUnavailable("cuDNN flash attention takes float16/bfloat16 only (use --dtype bfloat16)")

    def attn(q, k, v, mask):
        return jax.nn.dot_product_attention(q, k, v, mask=mask[None, None], implementation="cudnn")

    note = "dense: all S x S scores, the mask as an array (TFLOP/s counts the mask's useful FLOPs)"
    return replace(_compile_jax(attn, problem, (problem.dense_mask(),)), note=note)


def _prep_tokamax(problem: Problem) -> Prepared:
    if not _on_cuda():
        raise PeerUnavailable("tokamax's attention kernels need a CUDA GPU")
    try:
        tokamax = importlib.import_module("tokamax")
    except ImportError as e:
        raise PeerUnavailable(f"tokamax is not installed ({e})") from None
    s = problem.seq_len
    band = band_of(problem.layout)
    if band == (s - 1, s - 1):
        return _compile_jax(lambda q, k, v: tokamax.dot_product_attention(q, k, v), problem)
    if band is not None and band[1] == 0 and band[0] == s - 1:
        return _compile_jax(lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=True), problem)
    if band is not None:
        win = band
        return _compile_jax(
            lambda q, k, v: tokamax.dot_product_attention(q, k, v, local_window_size=win), problem
        )

    def attn(q, k, v, mask):
        return tokamax.dot_product_attention(q, k, v, mask=mask[None, None])

    return replace(_compile_jax(attn, problem, (problem.dense_mask(),)), note="dense mask array")


# FlashAttention-3's Hopper kernels, as the JAX binding is built for them: these head dims only.
FLASH_ATTN3_HEAD_DIMS = (128,)


def _hopper() -> bool:
    """Whether JAX's first device is an NVIDIA Hopper GPU (compute capability 9.x)."""
    import jax

    if not _on_cuda():
        return False
    cc = getattr(jax.devices()[0], "compute_capability", None)
    return cc is not None and str(cc).split(".")[0] == "9"


def takes_keyword(fn: Callable, name: str) -> bool:
    """Whether ``fn`` accepts keyword ``name`` (a peer's signature differs across its versions)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (a C extension, some wrappers)
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _prep_flash_attn3(problem: Problem) -> Prepared:
    """``flash_attn3_jax.flash_mha(q, k, v, softmax_scale=None, is_causal=False, window_size=(-1, -1))``."""
    try:
        fa3 = importlib.import_module("flash_attn3_jax")
    except ImportError as e:
        raise PeerUnavailable(f"flash_attn3_jax is not installed ({e})") from None
    if not _hopper():
        raise PeerUnavailable("FlashAttention-3 needs an NVIDIA Hopper GPU (compute capability 9.x)")
    if problem.dtype == "float32":
        raise PeerUnavailable("FlashAttention-3 takes float16/bfloat16 only (use --dtype bfloat16)")
    head_dim = problem.q.shape[-1]
    if head_dim not in FLASH_ATTN3_HEAD_DIMS:
        raise PeerUnavailable(f"FlashAttention-3 runs head dim {FLASH_ATTN3_HEAD_DIMS} only, not {head_dim}")
    kw = flash_attn3_arguments(problem.layout)
    if kw is None:
        raise PeerUnavailable("FlashAttention-3 takes only full, causal and (left, right) window masks")
    if takes_keyword(fa3.flash_mha, "softmax_scale"):  # its default is the same 1/sqrt(D)
        kw = {**kw, "softmax_scale": head_dim**-0.5}

    def attn(q, k, v):
        return fa3.flash_mha(q, k, v, **kw)

    note = f"is_causal={kw['is_causal']}, window={kw['window_size']}"
    return replace(_compile_jax(attn, problem), note=note)


# --- torch peers -----------------------------------------------------------------------------


def _torch_cuda():
    try:
        torch = importlib.import_module("torch")
    except ImportError as e:
        raise PeerUnavailable(f"torch is not installed ({e})") from None
    if not torch.cuda.is_available():
        raise PeerUnavailable("torch has no CUDA device here")
    return torch


def _torch_inputs(torch, problem: Problem):
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[problem.dtype]
    grad = problem.mode == "fwdbwd"
    out = []
    for a in (problem.q, problem.k, problem.v, problem.do):
        # torch layout is [B, H, S, D]
        t = torch.from_numpy(np.ascontiguousarray(a.transpose(0, 2, 1, 3))).to("cuda", dt)
        out.append(t)
    for t in out[:3]:
        t.requires_grad_(grad)
    return out, torch.cuda.synchronize


def _torch_to_host(t) -> np.ndarray:
    """A torch ``[B, H, S, D]`` tensor as float32 numpy ``[B, S, H, D]``."""
    return t.detach().float().cpu().numpy().transpose(0, 2, 1, 3)


def _torch_prepared(torch, fn, problem: Problem, note: str = "") -> Prepared:
    (q, k, v, do), sync = _torch_inputs(torch, problem)
    if problem.mode == "fwd":

        def launch():
            with torch.no_grad():
                return fn(q, k, v)
    else:

        def launch():
            for t in (q, k, v):
                t.grad = None
            out = fn(q, k, v)
            out.backward(do)
            return out

    def run():
        launch()
        sync()

    def outputs():
        out = launch()
        sync()
        if problem.mode == "fwd":
            return _torch_to_host(out)
        return _torch_to_host(out), tuple(_torch_to_host(t.grad) for t in (q, k, v))

    try:
        run()
    except Exception as e:  # unsupported shape/dtype in this torch build
        raise PeerUnavailable(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    return Prepared(run, None, note, outputs=outputs, launch=launch, sync=sync)


def compiled_flex(torch, fa):
    """``torch.compile(flex_attention)``, with dynamo's recompile limits lifted first.

    Every pattern and size compiles its own kernel: under the default limits later
    patterns silently fall back to eager FlexAttention (dense scores, a tiny
    fraction of its speed).
    """
    dynamo = importlib.import_module("torch._dynamo").config
    for name, limit in (
        ("cache_size_limit", 256),
        ("recompile_limit", 256),
        ("accumulated_cache_size_limit", 4096),
    ):
        if hasattr(dynamo, name):
            setattr(dynamo, name, max(limit, getattr(dynamo, name)))
    return torch.compile(fa.flex_attention, dynamic=False)


def _prep_flex(problem: Problem, soft_cap: float | None = None) -> Prepared:
    """FlexAttention with the problem's mask as a block mask (its operator form, else a dense
    table), query heads grouped where K/V have fewer (GQA), and ``soft_cap`` as its ``score_mod``
    (``cap * tanh(score / cap)``)."""
    torch = _torch_cuda()
    try:
        fa = importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError as e:
        raise PeerUnavailable(f"this torch has no FlexAttention ({e})") from None
    s = problem.seq_len
    expr = mask_expression(problem.mask)
    note = ""
    if expr is None:
        # No operator form: look the mask up in a dense table (costs FlexAttention memory traffic).
        table = torch.from_numpy(problem.dense_mask()).to("cuda")
        note = "mask_mod reads a dense table"

        def mask_mod(b, h, q_idx, kv_idx):
            return table[q_idx, kv_idx]
    else:

        def mask_mod(b, h, q_idx, kv_idx):
            return expr(q_idx, kv_idx)

    block_mask = fa.create_block_mask(mask_mod, B=None, H=None, Q_LEN=s, KV_LEN=s, device="cuda")
    flex = compiled_flex(torch, fa)

    def capped(score, b, h, qi, ki):
        return soft_cap * torch.tanh(score / soft_cap)

    score_mod = None if soft_cap is None else capped
    gqa = problem.k.shape[2] != problem.q.shape[2]

    def attend(q, k, v):
        return flex(q, k, v, block_mask=block_mask, score_mod=score_mod, enable_gqa=gqa)

    return _torch_prepared(torch, attend, problem, note)


def _prep_torch_sdpa(problem: Problem) -> Prepared:
    torch = _torch_cuda()
    attn_mod = importlib.import_module("torch.nn.attention")
    F = importlib.import_module("torch.nn.functional")
    backends = [attn_mod.SDPBackend.FLASH_ATTENTION, attn_mod.SDPBackend.EFFICIENT_ATTENTION]

    def fn(q, k, v):
        with attn_mod.sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q, k, v)

    return _torch_prepared(torch, fn, problem, note="no mask: dense ceiling")


PEERS: dict[str, Peer] = {
    p.name: p
    for p in (
        Peer("splat", "splat.attention", _prep_splat),
        Peer("splat_triton", "splat.attention(backend='triton'): splat's Triton kernels", _prep_splat_triton),
        Peer("splat_unfused", "splat sddmm -> softmax -> spmm", _prep_splat_unfused),
        Peer("dense_xla", "dense masked attention, jnp einsum + where + softmax", _prep_dense_xla),
        Peer("cudnn", "jax.nn.dot_product_attention(implementation='cudnn')", _prep_cudnn, gpu_only=True),
        Peer(
            "cudnn_dense",
            "jax.nn.dot_product_attention(implementation='cudnn') with a dense [S, S] mask: dense attention",
            _prep_cudnn_dense,
            gpu_only=True,
        ),
        Peer("tokamax", "tokamax.dot_product_attention", _prep_tokamax, gpu_only=True),
        Peer("flash_attn3", "FlashAttention-3, flash_attn3_jax.flash_mha", _prep_flash_attn3, gpu_only=True),
        Peer("flex", "torch.compile(flex_attention) + create_block_mask", _prep_flex, gpu_only=True),
        Peer(
            "torch_sdpa",
            "torch SDPA (flash/efficient), no mask: dense ceiling",
            _prep_torch_sdpa,
            gpu_only=True,
            no_check="no mask (dense ceiling)",
        ),
    )
}
