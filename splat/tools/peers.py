"""The implementations ``splat bench`` times splat against, all in one process.

Each peer turns a :class:`Problem` into a :class:`Prepared` run: a zero-argument
callable that computes the attention (forward, or forward + backward) and waits
for the device, plus XLA's temp-memory figure where the peer is a JAX program.
For timing, a JAX peer also compiles ``Problem.per_sample`` calls chained into one
executable (:func:`chain`), so no host dispatch falls between them, as attention
inside a jitted training step; torch peers launch their calls one by one.
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
tokamax         CUDA      ``tokamax.dot_product_attention``; windows as
                          ``local_window_size``, other masks as a dense mask array
flex            CUDA      PyTorch FlexAttention, ``torch.compile``d, with a
                          ``mask_mod`` translated from the splat mask
torch_sdpa      CUDA      dense torch SDPA (flash/efficient) with no mask at all:
                          the dense ceiling
==============  ========  ===========================================================
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np

__all__ = [
    "PEERS",
    "Peer",
    "PeerUnavailable",
    "Prepared",
    "Problem",
    "band_of",
    "chain",
    "compile_timed",
    "mask_expression",
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
      backend: splat's backend ("auto", "jax", "triton").
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


def _jax_dtype(name: str):
    import jax.numpy as jnp

    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


def chain(fn: Callable, n: int, feed: Mapping[int, int]) -> Callable:
    """``fn`` called ``n`` times back to back in one program, none merged, hoisted or dropped.

    For timing a call without per-call host dispatch: ``jax.jit(chain(fn, n, feed))``
    is one executable that makes ``n`` calls of ``fn``, each on inputs XLA must
    treat as new values that exist only once the previous call is done:

    * ``feed`` maps an argument index to the index of an output leaf
      (``jax.tree.leaves`` order) that replaces it in the next call: attention's
      ``out`` becomes the next ``q``, as in stacked layers. A true data
      dependency, which every backend keeps (XLA:CPU removes optimization
      barriers before its last CSE pass, and would merge calls on barriers alone).
    * All arguments and the previous outputs pass together through one
      ``jax.lax.optimization_barrier``, so work on the arguments that are not fed
      (``k``, ``v``) is redone per call, not hoisted or shared (XLA:GPU keeps
      barriers until after scheduling).
    * One element of each output leaf that is not fed is summed into a returned
      scalar: XLA prunes barrier outputs nobody reads, and with them the calls
      that made them. Those leaves stay alive to the end (memory, not time).

    The chain is unrolled in Python: a ``lax.fori_loop`` is an XLA while loop,
    whose condition XLA:GPU reads back on the host every iteration.

    Args:
      fn: ``fn(*args) -> pytree of arrays``.
      n: calls, at least 1.
      feed: ``{argument index: output leaf index}``; shapes and dtypes must match.

    Returns:
      ``chained(*args) -> (last call's output, float32 scalar)``.

    Example::

        chained = jax.jit(chain(lambda x: jnp.tanh(x @ x), 3, {0: 0}))
        out, _ = chained(jnp.eye(4))  # tanh applied 3 times, one dispatch
    """
    import jax
    import jax.numpy as jnp

    if n < 1:
        raise ValueError(f"chain needs n >= 1 calls, got {n}")
    fed = set(feed.values())

    def chained(*args):
        out = fn(*args)
        kept = []  # one element of each output leaf not fed forward
        for _ in range(n - 1):
            args, out = jax.lax.optimization_barrier((list(args), out))
            leaves = jax.tree.leaves(out)
            for a, o in feed.items():
                if (args[a].shape, args[a].dtype) != (leaves[o].shape, leaves[o].dtype):
                    raise ValueError(
                        f"feed {{{a}: {o}}}: output leaf {o} is {leaves[o].dtype}{list(leaves[o].shape)}, "
                        f"argument {a} is {args[a].dtype}{list(args[a].shape)}"
                    )
                args[a] = leaves[o]
            kept += [x.reshape(-1)[:1].astype(jnp.float32) for i, x in enumerate(leaves) if i not in fed]
            out = fn(*args)
        return out, jnp.concatenate(kept).sum() if kept else jnp.zeros((), jnp.float32)

    return chained


def compile_timed(
    fn: Callable, args: tuple, n: int, feed: Mapping[int, int]
) -> tuple[Callable, Callable[[], None], Callable[[], None]]:
    """``fn`` compiled for ``args``, and a launcher that times ``n`` calls in one executable.

    Returns ``(compiled, launch, sync)``: ``compiled(*args)`` makes one call (what
    the benchmark checks and reads memory figures from); ``launch()`` enqueues one
    run of ``chain(fn, n, feed)`` (:func:`chain`; ``compiled`` itself when ``n`` is
    1) and ``sync()`` waits for it. Each executable runs once here, so runtime
    failures (out of memory, ...) surface before any timing.
    """
    import jax

    compiled = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    timed = compiled if n == 1 else jax.jit(chain(fn, n, feed)).lower(*args).compile()
    pending = []

    def launch():
        pending[:] = [timed(*args)]

    def sync():
        jax.block_until_ready(pending)

    if n > 1:
        launch()
        sync()
    return compiled, launch, sync


def _jax_program(attn: Callable, problem: Problem, extra_args: tuple = ()) -> tuple[Callable, tuple, dict]:
    """``(fn, args, feed)``: ``attn(q, k, v, *extra_args)`` (with its VJP in fwdbwd mode) on the inputs.

    ``feed`` (see :func:`chain`) chains calls as stacked layers would: ``out`` is
    the next call's ``q``, and in fwdbwd mode ``dq`` its output cotangent ``do``.
    """
    import jax
    import jax.numpy as jnp

    dt = _jax_dtype(problem.dtype)
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


def band_of(layout) -> tuple[int, int] | None:
    """``(left, right)`` when the layout is exactly the band ``i - left <= j <= i + right``, else None.

    Works from the layout's rows (O(S) after one CSR pass), so any mask that *is*
    a window qualifies, however it was written. ``left``/``right`` are capped at
    ``kv_len - 1`` (so full attention is ``(S-1, S-1)`` and causal ``(S-1, 0)``).
    """
    import acsr

    q_len, kv_len = layout.q_len, layout.kv_len
    indptr, cols = acsr.to_csr(layout)
    counts = np.diff(indptr)
    if (counts == 0).any():
        return None
    first = cols[indptr[:-1]].astype(np.int64)
    last = cols[indptr[1:] - 1].astype(np.int64)
    if not np.array_equal(last - first + 1, counts):  # not one contiguous run per row
        return None
    r = np.arange(q_len)
    left = int(min(max((r - first).max(), 0), kv_len - 1))
    right = int(min(max((last - r).max(), 0), kv_len - 1))
    if np.array_equal(first, np.clip(r - left, 0, kv_len - 1)) and np.array_equal(
        last, np.clip(r + right, 0, kv_len - 1)
    ):
        return left, right
    return None


def mask_expression(mask) -> Callable | None:
    """The mask as ``f(q_idx, kv_idx)`` written with operators only (``- % // < <= & |``).

    The same function then runs on numpy arrays (tested against ``mask(q, kv)``)
    and on torch tensors inside FlexAttention's ``mask_mod``. Returns None for
    masks with no such form (arrays, user functions).
    """
    from splat import masks as M

    if isinstance(mask, M.Full):
        return lambda q, kv: (q >= 0) | (kv >= 0)
    if isinstance(mask, M.Causal):
        return lambda q, kv: kv <= q
    if isinstance(mask, M.SlidingWindow):
        left, right = mask.left, mask.right
        return lambda q, kv: (q - kv <= left) & (kv - q <= right)
    if isinstance(mask, M.DilatedWindow):
        rad, dil = mask.radius, mask.dilation
        return lambda q, kv: (q - kv <= rad) & (kv - q <= rad) & ((q - kv) % dil == 0)
    if isinstance(mask, M.Strided):
        st = mask.stride
        return lambda q, kv: (q - kv >= 0) & ((q - kv) % st == 0)
    if isinstance(mask, M.BlockLocal):
        blk, lb = mask.block, mask.lookback
        return lambda q, kv: (kv // blk <= q // blk) & (kv // blk >= q // blk - lb)
    if isinstance(mask, M.GlobalTokens):
        n = mask.n
        return lambda q, kv: (q < n) | (kv < n)
    if isinstance(mask, M.Sink):
        n = mask.n
        return lambda q, kv: (kv < n) & (q >= 0)
    if isinstance(mask, (M.Union, M.Intersection)):
        a, b = mask_expression(mask.a), mask_expression(mask.b)
        if a is None or b is None:
            return None
        if isinstance(mask, M.Union):
            return lambda q, kv: a(q, kv) | b(q, kv)
        return lambda q, kv: a(q, kv) & b(q, kv)
    return None


# --- JAX peers ---------------------------------------------------------------------------


def _prep_splat(problem: Problem) -> Prepared:
    import splat

    if not hasattr(splat, "attention"):
        raise PeerUnavailable("splat.attention is not available in this build")
    mask, backend = problem.mask, problem.backend
    return _compile_jax(lambda q, k, v: splat.attention(q, k, v, mask=mask, backend=backend), problem)


def _prep_splat_unfused(problem: Problem) -> Prepared:
    import splat

    if not all(hasattr(splat, n) for n in ("sddmm", "softmax", "spmm")):
        raise PeerUnavailable("splat.sddmm/softmax/spmm are not available in this build")
    layout, backend = problem.layout, problem.backend

    def attn(q, k, v):
        s = splat.sddmm(q, k, layout, backend=backend)
        p = splat.softmax(s, layout, scale=q.shape[-1] ** -0.5, backend=backend)
        return splat.spmm(p, v, layout, backend=backend)

    return _compile_jax(attn, problem)


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


def _prep_flex(problem: Problem) -> Prepared:
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
    # every pattern and size compiles its own kernel: lift dynamo's recompile limits, or later
    # patterns silently fall back to eager FlexAttention (dense scores, a tiny fraction of its speed)
    dynamo = importlib.import_module("torch._dynamo").config
    for name, limit in (
        ("cache_size_limit", 256),
        ("recompile_limit", 256),
        ("accumulated_cache_size_limit", 4096),
    ):
        if hasattr(dynamo, name):
            setattr(dynamo, name, max(limit, getattr(dynamo, name)))
    flex = torch.compile(fa.flex_attention, dynamic=False)
    return _torch_prepared(torch, lambda q, k, v: flex(q, k, v, block_mask=block_mask), problem, note)


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
        Peer("splat_unfused", "splat sddmm -> softmax -> spmm", _prep_splat_unfused),
        Peer("dense_xla", "dense masked attention, jnp einsum + where + softmax", _prep_dense_xla),
        Peer("cudnn", "jax.nn.dot_product_attention(implementation='cudnn')", _prep_cudnn, gpu_only=True),
        Peer("tokamax", "tokamax.dot_product_attention", _prep_tokamax, gpu_only=True),
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
