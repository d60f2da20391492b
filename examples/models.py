"""Example models (Flax NNX) whose attention runs through splat.

* :class:`GPT`: a decoder with Gemma-2-style alternating layers: even layers
  attend to a causal sliding window of ``window`` keys (self included), odd
  layers are global causal.
* :class:`Longformer`: an encoder whose every layer attends to a symmetric
  window of ``window`` keys either side plus ``global_tokens`` global tokens
  (they see, and are seen by, every position).

``attention="splat"`` plugs :func:`splat.flax.attention_fn` into each
``nnx.MultiHeadAttention``; ``attention="dense"`` gives the dense twin, the
same parameters with ``jax.nn.dot_product_attention`` (XLA, or cuDNN via
``dense_impl="cudnn"``) applying the same masks. Built from the same seed, the
two have identical parameters (the attention function holds none).

Example:
  >>> import jax.numpy as jnp, flax.nnx as nnx
  >>> from examples.models import GPT, GPTConfig
  >>> cfg = GPTConfig(layers=2, width=32, heads=2, seq_len=64, window=8, vocab=50)
  >>> model = GPT(cfg, attention="splat", rngs=nnx.Rngs(0))
  >>> model(jnp.zeros((1, 64), jnp.int32)).shape
  (1, 64, 50)
"""

from __future__ import annotations

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

import splat.flax
from examples.common import GPTConfig, LongformerConfig, layer_masks

__all__ = ["GPT", "GPTConfig", "Longformer", "LongformerConfig", "build", "layer_masks"]


def _dense_attention_fn(*, is_causal=False, window=None, mask=None, implementation=None):
    """An nnx ``attention_fn`` running ``jax.nn.dot_product_attention`` with a fixed mask."""

    def fn(query, key, value, bias=None, mask_arg=None, *args, **kwargs):
        return jax.nn.dot_product_attention(
            query,
            key,
            value,
            mask=mask,
            is_causal=is_causal,
            local_window_size=window,
            implementation=implementation,
        )

    return fn


def _attention_fns(cfg, attention: str, dense_impl: str | None) -> list:
    if attention == "splat":
        return [splat.flax.attention_fn(m) for m in layer_masks(cfg)]
    if attention != "dense":
        raise ValueError(f'attention must be "splat" or "dense", got {attention!r}')
    if isinstance(cfg, GPTConfig):
        local = _dense_attention_fn(is_causal=True, window=(cfg.window - 1, 0), implementation=dense_impl)
        full = _dense_attention_fn(is_causal=True, implementation=dense_impl)
        return [local if i % 2 == 0 else full for i in range(cfg.layers)]
    i = np.arange(cfg.seq_len)
    dense = layer_masks(cfg)[0](i[:, None], i[None, :])
    fn = _dense_attention_fn(mask=jnp.asarray(dense)[None, None], implementation=dense_impl)
    return [fn] * cfg.layers


class Block(nnx.Module):
    """Pre-norm transformer block: attention + MLP."""

    def __init__(self, cfg, attention_fn, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.norm1 = nnx.RMSNorm(cfg.width, dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=cfg.heads,
            in_features=cfg.width,
            qkv_features=cfg.width,
            out_features=cfg.width,
            dtype=dtype,
            attention_fn=attention_fn,
            decode=False,
            rngs=rngs,
        )
        self.norm2 = nnx.RMSNorm(cfg.width, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(cfg.width, cfg.mlp_ratio * cfg.width, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(cfg.mlp_ratio * cfg.width, cfg.width, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class _Transformer(nnx.Module):
    def __init__(self, cfg, attention: str, dense_impl: str | None, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.attention = attention
        dtype = jnp.dtype(cfg.dtype)
        self.embed = nnx.Embed(cfg.vocab, cfg.width, dtype=dtype, rngs=rngs)
        self.pos = nnx.Embed(cfg.seq_len, cfg.width, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List(
            [Block(cfg, fn, rngs=rngs) for fn in _attention_fns(cfg, attention, dense_impl)]
        )
        self.norm = nnx.RMSNorm(cfg.width, dtype=dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens: int [B, S] (S <= seq_len) -> logits float32 [B, S, vocab]."""
        if tokens.ndim != 2 or tokens.shape[1] > self.cfg.seq_len:
            raise ValueError(f"tokens must be [B, S] with S <= {self.cfg.seq_len}, got shape {tokens.shape}")
        x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))[None]
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.norm(x)).astype(jnp.float32)


class GPT(_Transformer):
    """Decoder: alternating causal sliding-window (even) and global causal (odd) layers.

    Args:
      cfg: sizes.
      attention: "splat" or "dense" (the dense twin).
      dense_impl: ``implementation=`` for ``jax.nn.dot_product_attention`` in the
        dense twin (None/"xla"/"cudnn").
      rngs: parameter init.
    """

    def __init__(
        self, cfg: GPTConfig, attention: str = "splat", dense_impl: str | None = None, *, rngs: nnx.Rngs
    ):
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")
        super().__init__(cfg, attention, dense_impl, rngs=rngs)


class Longformer(_Transformer):
    """Encoder: every layer sees a symmetric window plus global tokens.

    Args: as :class:`GPT`, with a :class:`LongformerConfig`.
    """

    def __init__(
        self,
        cfg: LongformerConfig,
        attention: str = "splat",
        dense_impl: str | None = None,
        *,
        rngs: nnx.Rngs,
    ):
        if not isinstance(cfg, LongformerConfig):
            raise TypeError(f"cfg must be a LongformerConfig, got {type(cfg).__name__}")
        super().__init__(cfg, attention, dense_impl, rngs=rngs)


def build(cfg, attention: str = "splat", seed: int = 0, dense_impl: str | None = None):
    """The model for ``cfg`` (GPT or Longformer) with parameters from ``seed``."""
    cls = GPT if isinstance(cfg, GPTConfig) else Longformer
    return cls(cfg, attention, dense_impl, rngs=nnx.Rngs(seed))
