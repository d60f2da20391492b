"""The GPT example as pure JAX: no flax, no optax (only jax, numpy, splat).

A functional twin of :class:`examples.models.GPT` for machines whose JAX is
newer than the installed flax supports. Same architecture and numerics as the
Flax NNX model with ``dtype=cfg.dtype``:

* ``x = embed[tokens] + pos[:S]``, both tables float32, cast to the compute
  dtype before the lookup (``nnx.Embed``);
* per block, pre-norm: ``x += attn(rms_norm(x))``, ``x += down(gelu(up(rms_norm(x))))``
  with ``nnx.RMSNorm`` (eps 1e-6, learned ``scale``, statistics in float32,
  result cast back), ``nnx.MultiHeadAttention`` projections (``query``/``key``/
  ``value`` kernels ``[W, H, D]`` + biases ``[H, D]``, ``out`` kernel
  ``[H, D, W]`` + bias ``[W]``; no scaling there, the attention applies
  ``1/sqrt(D)``), ``nnx.Linear`` MLP with biases, tanh-approximated GELU
  (``jax.nn.gelu``'s default);
* final RMSNorm, logits through the tied embedding (``embed.attend``), cast to
  float32.

Parameters are float32; every matmul casts its operands to ``cfg.dtype``
first, as nnx's ``promote_dtype`` does. Even layers attend to a causal window
of ``cfg.window`` keys (self included), odd layers are global causal.

Attention modes (``attention=``), one per whole model:

* ``"splat"``: :func:`splat.attention` with the layer's splat mask (Triton on
  a CUDA GPU, pure JAX elsewhere).
* ``"cudnn_window"``: ``jax.nn.dot_product_attention(implementation="cudnn")``
  with ``is_causal=True`` and, on local layers, ``local_window_size=(window-1, 0)``
  (cuDNN's native sliding window).
* ``"cudnn_mask"``: the same call with the local layers' window as a dense
  boolean ``mask`` ``[1, 1, S, S]`` (built in the graph from iotas) plus
  ``is_causal=True`` -- what a JAX user writes without a windowed kernel.
* ``"xla"`` / ``"xla_mask"``: as the two above with ``implementation="xla"``;
  they run on any backend (``"xla_mask"`` checks the dense mask on CPU).

The cuDNN modes need a CUDA GPU; elsewhere they raise ``ValueError`` at trace
time (nothing is silently swapped; pick ``"xla"`` there).

Packed documents (``eod=``): a row of ``tokens`` holds several documents, each
ended by the token ``eod``. :func:`document_ids` derives from the tokens, inside
the jitted step, each token's document id and its position in its document;
attention is then document-causal -- ``segment_ids`` AND the layer's static mask
for splat, a dense ``[B, 1, S, S]`` mask for the other modes -- and positions
restart at 0 in every document, so a packed row computes exactly what its
documents would alone.

Decode with a KV cache (splat only): :func:`init_cache` and :func:`extend` run
``T`` new tokens (a prompt, then one token a step) against the cached keys and
values; the new queries sit at ``q_offset = cache["pos"]``, so the layers'
static masks (causal, causal window) are applied at their true positions and
the logits equal the full-sequence ones. :func:`generate` decodes greedily.

Example:
  >>> import jax.numpy as jnp
  >>> from examples.common import GPTConfig
  >>> from examples import gpt_jax
  >>> cfg = GPTConfig(layers=2, width=32, heads=2, seq_len=64, window=8, vocab=50)
  >>> params = gpt_jax.init_params(cfg, seed=0)
  >>> gpt_jax.forward(params, jnp.zeros((1, 64), jnp.int32), cfg, "splat").shape
  (1, 64, 50)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import splat
from examples.common import GPTConfig, layer_masks

__all__ = [
    "ATTENTION_MODES",
    "adam_init",
    "adam_update",
    "document_ids",
    "extend",
    "extend_jit",
    "forward",
    "generate",
    "init_cache",
    "init_params",
    "loss_fn",
    "make_train_step",
    "params_from_flax",
]

ATTENTION_MODES = ("splat", "cudnn_window", "cudnn_mask", "xla", "xla_mask")

_RMS_EPS = 1e-6  # nnx.RMSNorm default

# jax.nn.initializers equal to nnx's defaults (nnx.Linear / LinearGeneral / Embed)
_kernel_init = jax.nn.initializers.lecun_normal()
_embed_init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)


# -----------------------------------------------------------------------------
# parameters
# -----------------------------------------------------------------------------


def init_params(cfg: GPTConfig, seed: int = 0) -> dict:
    """Fresh float32 parameters, a plain pytree (dicts and a list of per-block dicts).

    Shapes (W = width, H = heads, D = W // H, F = mlp_ratio * W)::

      embed [vocab, W], pos [seq_len, W], norm [W],
      blocks[i]: norm1 [W], norm2 [W],
                 q/k/v: kernel [W, H, D], bias [H, D];  out: kernel [H, D, W], bias [W],
                 up: kernel [W, F], bias [F];  down: kernel [F, W], bias [W]

    Initialisers follow nnx's defaults (LeCun normal kernels on the flattened
    ``[fan_in, fan_out]`` shape, zero biases, unit norm scales, embeddings
    normal with std ``1/sqrt(W)``); the values differ from a Flax model built
    with the same seed -- use :func:`params_from_flax` to copy one.
    """
    _check_cfg(cfg)
    return _init_params(cfg, jax.random.key(seed))


@functools.partial(jax.jit, static_argnums=0)  # one compile instead of one per eager op
def _init_params(cfg: GPTConfig, key: jax.Array) -> dict:
    w, h = cfg.width, cfg.heads
    d, f = w // h, cfg.mlp_ratio * w
    f32 = jnp.float32
    keys = iter(jax.random.split(key, 2 + 6 * cfg.layers))

    def dense(in_shape, out_shape):
        flat = (int(np.prod(in_shape)), int(np.prod(out_shape)))
        kernel = _kernel_init(next(keys), flat, f32).reshape(*in_shape, *out_shape)
        return {"kernel": kernel, "bias": jnp.zeros(out_shape, f32)}

    params = {
        "embed": _embed_init(next(keys), (cfg.vocab, w), f32),
        "pos": _embed_init(next(keys), (cfg.seq_len, w), f32),
        "blocks": [],
        "norm": jnp.ones((w,), f32),
    }
    for _ in range(cfg.layers):
        params["blocks"].append(
            {
                "norm1": jnp.ones((w,), f32),
                "q": dense((w,), (h, d)),
                "k": dense((w,), (h, d)),
                "v": dense((w,), (h, d)),
                "out": dense((h, d), (w,)),
                "norm2": jnp.ones((w,), f32),
                "up": dense((w,), (f,)),
                "down": dense((f,), (w,)),
            }
        )
    return params


def params_from_flax(model) -> dict:
    """The parameters of an :class:`examples.models.GPT` (Flax NNX) as this module's pytree.

    Reads the model's attributes only (no flax import here); the result is a
    copy of the float32 values.
    """

    def val(v):
        return jnp.array(v[...])

    def lin(m):
        return {"kernel": val(m.kernel), "bias": val(m.bias)}

    return {
        "embed": val(model.embed.embedding),
        "pos": val(model.pos.embedding),
        "blocks": [
            {
                "norm1": val(b.norm1.scale),
                "q": lin(b.attn.query),
                "k": lin(b.attn.key),
                "v": lin(b.attn.value),
                "out": lin(b.attn.out),
                "norm2": val(b.norm2.scale),
                "up": lin(b.up),
                "down": lin(b.down),
            }
            for b in model.blocks
        ],
        "norm": val(model.norm.scale),
    }


# -----------------------------------------------------------------------------
# model
# -----------------------------------------------------------------------------


def _check_cfg(cfg) -> None:
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"cfg must be an examples.common.GPTConfig, got {type(cfg).__name__}")


def _rms_norm(x, scale, dt):
    """nnx.RMSNorm: ``x * rsqrt(mean(x^2) + eps) * scale`` in float32, cast to ``dt``."""
    x, scale = x.astype(dt), scale.astype(dt)
    stats = jnp.promote_types(dt, jnp.float32)
    var = jnp.mean(lax.square(x.astype(stats)), axis=-1, keepdims=True)
    mul = lax.rsqrt(var + _RMS_EPS) * scale
    return (x.astype(stats) * mul).astype(dt)


def _linear(x, p, n_in: int, dt):
    """nnx.Linear / LinearGeneral: contract the last ``n_in`` axes of ``x`` with the kernel's first."""
    kernel, bias = p["kernel"].astype(dt), p["bias"].astype(dt)
    x = x.astype(dt)
    axes = tuple(range(x.ndim - n_in, x.ndim))
    y = lax.dot_general(x, kernel, ((axes, tuple(range(n_in))), ((), ())))
    return y + bias


def _local_mask(s: int, window: int) -> jax.Array:
    """Dense bool [1, 1, S, S]: key j visible to query i iff ``0 <= i - j < window``."""
    i = lax.broadcasted_iota(jnp.int32, (s, s), 0)
    j = lax.broadcasted_iota(jnp.int32, (s, s), 1)
    return ((i - j >= 0) & (i - j < window))[None, None]


def document_ids(tokens: jax.Array, eod: int) -> tuple[jax.Array, jax.Array]:
    """``(segment_ids, positions)``, int32 ``[B, S]`` each, of packed documents ended by ``eod``.

    Token ``i`` belongs to document ``segment_ids[b, i]`` (the number of ``eod``
    tokens before it: an ``eod`` ends its own document) and sits at position
    ``positions[b, i]`` of it (0 at each document's first token). Traceable.

    Example:
      >>> import jax.numpy as jnp
      >>> seg, pos = document_ids(jnp.array([[5, 6, 0, 7, 0, 8]]), eod=0)
      >>> seg.tolist(), pos.tolist()
      ([[0, 0, 0, 1, 1, 2]], [[0, 1, 2, 0, 1, 0]])
    """
    ends = (tokens == eod).astype(jnp.int32)
    seg = jnp.cumsum(ends, axis=1) - ends
    i = lax.broadcasted_iota(jnp.int32, tokens.shape, 1)
    starts = jnp.pad(ends[:, :-1], ((0, 0), (1, 0)), constant_values=1).astype(bool)
    pos = i - lax.cummax(jnp.where(starts, i, 0), axis=1)
    return seg, pos


def _attention_fns(cfg: GPTConfig, attention: str) -> list[Callable]:
    """One ``fn(q, k, v, segment_ids) -> out`` ([B, S, H, D]; ``segment_ids`` [B, S] or None) per layer."""
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    if attention == "splat":
        return [
            lambda q, k, v, seg, m=m: splat.attention(q, k, v, mask=m, segment_ids=seg)
            for m in layer_masks(cfg)
        ]
    impl, how = attention.split("_") if "_" in attention else (attention, "window")
    if impl == "cudnn" and jax.default_backend() != "gpu":
        raise ValueError(
            f'attention="{attention}" runs cuDNN attention, which needs a CUDA GPU; the default '
            f'backend is "{jax.default_backend()}". Use "xla" or "xla_mask" (same maths, XLA) there'
        )

    def dense(local: bool):
        def fn(q, k, v, seg):
            window, mask = None, None
            if local and how == "window":
                window = (cfg.window - 1, 0)
            elif local:
                mask = _local_mask(q.shape[1], cfg.window)
            if seg is not None:  # documents: a dense [B, 1, S, S] mask
                same = (seg[:, :, None] == seg[:, None, :])[:, None]
                mask = same if mask is None else mask & same
            return jax.nn.dot_product_attention(
                q, k, v, mask=mask, is_causal=True, local_window_size=window, implementation=impl
            )

        return fn

    return [dense(local=i % 2 == 0) for i in range(cfg.layers)]


def _check_forward(params, tokens, cfg, max_len: int) -> None:
    _check_cfg(cfg)
    if tokens.ndim != 2 or tokens.shape[1] > max_len:
        raise ValueError(f"tokens must be [B, S] with S <= {max_len}, got shape {tokens.shape}")
    if len(params["blocks"]) != cfg.layers:
        raise ValueError(f"params have {len(params['blocks'])} blocks, cfg.layers = {cfg.layers}")


def _block(x, p, attend: Callable, dt):
    """One pre-norm block; ``attend(q, k, v)`` is the attention."""
    h = _rms_norm(x, p["norm1"], dt)
    q, k, v = (_linear(h, p[n], 1, dt) for n in ("q", "k", "v"))
    x = x + _linear(attend(q, k, v), p["out"], 2, dt)
    h = _rms_norm(x, p["norm2"], dt)
    return x + _linear(jax.nn.gelu(_linear(h, p["up"], 1, dt)), p["down"], 1, dt)


def _embed(params, tokens, positions, dt):
    emb = params["embed"].astype(dt)
    return emb, jnp.take(emb, tokens, axis=0) + jnp.take(params["pos"].astype(dt), positions, axis=0)


def _logits(params, x, emb, dt):
    x = _rms_norm(x, params["norm"], dt)
    return jnp.dot(x, emb.T).astype(jnp.float32)


def forward(
    params: dict, tokens: jax.Array, cfg: GPTConfig, attention: str = "splat", *, eod: int | None = None
) -> jax.Array:
    """Logits float32 ``[B, S, vocab]`` for int tokens ``[B, S]`` (``S <= cfg.seq_len``).

    ``eod``: the rows are packed documents ended by this token (see :func:`document_ids`);
    None: each row is one sequence.
    """
    _check_forward(params, tokens, cfg, cfg.seq_len)
    dt = jnp.dtype(cfg.dtype)
    attn_fns = _attention_fns(cfg, attention)
    if eod is None:
        seg, positions = None, jnp.arange(tokens.shape[1])
    else:
        seg, positions = document_ids(tokens, eod)
    emb, x = _embed(params, tokens, positions, dt)
    for p, attn in zip(params["blocks"], attn_fns, strict=True):
        x = _block(x, p, lambda q, k, v, attn=attn: attn(q, k, v, seg), dt)
    return _logits(params, x, emb, dt)


def loss_fn(
    params, tokens, labels, weights, cfg: GPTConfig, attention: str = "splat", eod: int | None = None
) -> jax.Array:
    """Mean cross-entropy over weighted positions (as ``examples.train.loss_fn``).

    ``eod``: as :func:`forward`.
    """
    logits = forward(params, tokens, cfg, attention, eod=eod)
    logz = jax.nn.logsumexp(logits, axis=-1)
    label_logit = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return ((logz - label_logit) * weights).sum() / weights.sum()


# -----------------------------------------------------------------------------
# Adam and the training step
# -----------------------------------------------------------------------------


@jax.jit
def adam_init(params) -> dict:
    """Adam state: step count and zero first/second moments shaped like ``params``."""
    zeros = lambda p: jnp.zeros_like(p)
    return {
        "step": jnp.zeros((), jnp.int32),
        "mu": jax.tree.map(zeros, params),
        "nu": jax.tree.map(zeros, params),
    }


def adam_update(params, grads, state, lr: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8):
    """One bias-corrected Adam step, no weight decay (as ``optax.adam``); returns ``(params, state)``."""
    t = state["step"] + 1
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["mu"], grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["nu"], grads)
    tf = t.astype(jnp.float32)
    c1, c2 = 1 - b1**tf, 1 - b2**tf
    params = jax.tree.map(lambda p, m, v: p - lr * (m / c1) / (jnp.sqrt(v / c2) + eps), params, mu, nu)
    return params, {"step": t, "mu": mu, "nu": nu}


def make_train_step(
    cfg: GPTConfig, attention: str = "splat", *, lr: float = 1e-3, donate: bool = True, eod: int | None = None
):
    """A jitted ``step(params, opt_state, tokens, labels, weights) -> (params, opt_state, loss)``.

    ``donate``: the step reuses the buffers of ``params`` and ``opt_state``
    (do not touch the passed-in ones afterwards). ``eod``: the batches are packed
    documents ended by this token (:func:`forward`); one compile serves any packing.
    """
    _check_cfg(cfg)
    _attention_fns(cfg, attention)  # fail now, not inside jit, on a bad mode / backend

    def step(params, opt_state, tokens, labels, weights):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, labels, weights, cfg, attention, eod)
        params, opt_state = adam_update(params, grads, opt_state, lr)
        return params, opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())


# -----------------------------------------------------------------------------
# decode with a KV cache
# -----------------------------------------------------------------------------


def init_cache(cfg: GPTConfig, batch: int, length: int | None = None) -> dict:
    """An empty KV cache for ``batch`` rows of up to ``length`` tokens (default ``cfg.seq_len``).

    ``{"k": [L x [B, length, H, D]], "v": likewise, "pos": int32 [B]}`` in the compute
    dtype; ``pos`` is the number of tokens cached so far in each row.
    """
    _check_cfg(cfg)
    length = cfg.seq_len if length is None else length
    if not 0 < length <= cfg.seq_len:
        raise ValueError(f"length must be in [1, cfg.seq_len = {cfg.seq_len}], got {length}")
    shape = (batch, length, cfg.heads, cfg.width // cfg.heads)
    zeros = [jnp.zeros(shape, cfg.dtype) for _ in range(cfg.layers)]
    return {"k": zeros, "v": list(zeros), "pos": jnp.zeros((batch,), jnp.int32)}


def _write(cache: jax.Array, new: jax.Array, pos: jax.Array) -> jax.Array:
    """``cache [B, L, H, D]`` with ``new [B, T, H, D]`` written at rows ``pos[b] ..`` of each batch row."""
    return jax.vmap(lambda c, x, p: lax.dynamic_update_slice_in_dim(c, x, p, axis=0))(cache, new, pos)


def extend(params: dict, cache: dict, tokens: jax.Array, cfg: GPTConfig) -> tuple[jax.Array, dict]:
    """Runs ``T`` new tokens ``[B, T]`` after the cached ones: ``(logits [B, T, vocab], cache)``.

    A prompt (``T`` tokens into an empty cache), then one token a step. The new
    queries sit at positions ``cache["pos"] + i``: splat gets ``q_offset =
    cache["pos"]`` (the static mask is applied at those rows) and
    ``key_value_seq_lengths = cache["pos"] + T`` (the empty cache slots are not
    seen). The logits equal :func:`forward`'s at the same positions. Splat
    attention only; jit it with ``cfg`` static (one compile per ``T``). The
    caller keeps ``cache["pos"] + T`` within the cache's length.
    """
    _check_forward(params, tokens, cfg, cache["k"][0].shape[1])
    dt = jnp.dtype(cfg.dtype)
    t, pos = tokens.shape[1], cache["pos"]
    emb, x = _embed(params, tokens, pos[:, None] + jnp.arange(t), dt)
    new = {"k": [], "v": [], "pos": pos + t}
    for i, (p, m) in enumerate(zip(params["blocks"], layer_masks(cfg), strict=True)):

        def attend(q, k, v, i=i, m=m):
            ck, cv = _write(cache["k"][i], k, pos), _write(cache["v"][i], v, pos)
            new["k"].append(ck)
            new["v"].append(cv)
            return splat.attention(q, ck, cv, mask=m, q_offset=pos, key_value_seq_lengths=pos + t)

        x = _block(x, p, attend, dt)
    return _logits(params, x, emb, dt), new


extend_jit = jax.jit(extend, static_argnums=3)
"""``jax.jit(extend)`` with ``cfg`` static: one compile per ``(T, cache length)``, shared by all callers."""


def generate(params: dict, prompt: jax.Array, cfg: GPTConfig, steps: int) -> jax.Array:
    """Greedy decoding: ``prompt [B, P]`` followed by ``steps`` generated tokens, ``[B, P + steps]``.

    The prompt runs once through :func:`extend`, then one token a step against the cache
    (:data:`extend_jit`: two compiles, the prompt's and the step's, reused by later calls
    of the same sizes).
    """
    if prompt.shape[1] + steps > cfg.seq_len:
        raise ValueError(f"prompt length + steps must be <= cfg.seq_len = {cfg.seq_len}")
    run = extend_jit
    cache = init_cache(cfg, prompt.shape[0], prompt.shape[1] + steps)
    logits, cache = run(params, cache, prompt, cfg)
    out = [prompt]
    for i in range(steps):
        out.append(jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32))
        if i + 1 < steps:
            logits, cache = run(params, cache, out[-1], cfg)
    return jnp.concatenate(out, axis=1)
