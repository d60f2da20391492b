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
    "forward",
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


def _attention_fns(cfg: GPTConfig, attention: str) -> list[Callable]:
    """One ``fn(q, k, v) -> out`` ([B, S, H, D]) per layer."""
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    if attention == "splat":
        return [lambda q, k, v, m=m: splat.attention(q, k, v, mask=m) for m in layer_masks(cfg)]
    impl, how = attention.split("_") if "_" in attention else (attention, "window")
    if impl == "cudnn" and jax.default_backend() != "gpu":
        raise ValueError(
            f'attention="{attention}" runs cuDNN attention, which needs a CUDA GPU; the default '
            f'backend is "{jax.default_backend()}". Use "xla" or "xla_mask" (same maths, XLA) there'
        )

    def dense(local: bool):
        def fn(q, k, v):
            window, mask = None, None
            if local and how == "window":
                window = (cfg.window - 1, 0)
            elif local:
                mask = _local_mask(q.shape[1], cfg.window)
            return jax.nn.dot_product_attention(
                q, k, v, mask=mask, is_causal=True, local_window_size=window, implementation=impl
            )

        return fn

    return [dense(local=i % 2 == 0) for i in range(cfg.layers)]


def forward(params: dict, tokens: jax.Array, cfg: GPTConfig, attention: str = "splat") -> jax.Array:
    """Logits float32 ``[B, S, vocab]`` for int tokens ``[B, S]`` (``S <= cfg.seq_len``)."""
    _check_cfg(cfg)
    if tokens.ndim != 2 or tokens.shape[1] > cfg.seq_len:
        raise ValueError(f"tokens must be [B, S] with S <= {cfg.seq_len}, got shape {tokens.shape}")
    if len(params["blocks"]) != cfg.layers:
        raise ValueError(f"params have {len(params['blocks'])} blocks, cfg.layers = {cfg.layers}")
    dt = jnp.dtype(cfg.dtype)
    attn_fns = _attention_fns(cfg, attention)
    emb = params["embed"].astype(dt)
    x = jnp.take(emb, tokens, axis=0) + jnp.take(
        params["pos"].astype(dt), jnp.arange(tokens.shape[1]), axis=0
    )
    for p, attn in zip(params["blocks"], attn_fns, strict=True):
        h = _rms_norm(x, p["norm1"], dt)
        q, k, v = (_linear(h, p[n], 1, dt) for n in ("q", "k", "v"))
        x = x + _linear(attn(q, k, v), p["out"], 2, dt)
        h = _rms_norm(x, p["norm2"], dt)
        x = x + _linear(jax.nn.gelu(_linear(h, p["up"], 1, dt)), p["down"], 1, dt)
    x = _rms_norm(x, params["norm"], dt)
    return jnp.dot(x, emb.T).astype(jnp.float32)


def loss_fn(params, tokens, labels, weights, cfg: GPTConfig, attention: str = "splat") -> jax.Array:
    """Mean cross-entropy over weighted positions (as ``examples.train.loss_fn``)."""
    logits = forward(params, tokens, cfg, attention)
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


def make_train_step(cfg: GPTConfig, attention: str = "splat", *, lr: float = 1e-3, donate: bool = True):
    """A jitted ``step(params, opt_state, tokens, labels, weights) -> (params, opt_state, loss)``.

    ``donate``: the step reuses the buffers of ``params`` and ``opt_state``
    (do not touch the passed-in ones afterwards).
    """
    _check_cfg(cfg)
    _attention_fns(cfg, attention)  # fail now, not inside jit, on a bad mode / backend

    def step(params, opt_state, tokens, labels, weights):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, labels, weights, cfg, attention)
        params, opt_state = adam_update(params, grads, opt_state, lr)
        return params, opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())
