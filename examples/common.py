"""The examples' flax-free parts: model configs, per-layer masks, synthetic batches.

Imports only numpy and splat, so the pure-JAX model (:mod:`examples.gpt_jax`)
and its benchmark run where flax and optax cannot be imported.
:mod:`examples.models` and :mod:`examples.train` re-export all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from splat import masks

__all__ = ["GPTConfig", "LongformerConfig", "layer_masks", "make_batch", "make_packed_batch"]


@dataclass(frozen=True)
class GPTConfig:
    """Decoder size. ``window`` = keys a local layer sees, itself included."""

    vocab: int = 256
    layers: int = 4
    width: int = 128
    heads: int = 4
    seq_len: int = 256
    window: int = 32
    mlp_ratio: int = 4
    dtype: str = "float32"  # compute dtype; parameters stay float32

    def __post_init__(self):
        _check(self)


@dataclass(frozen=True)
class LongformerConfig:
    """Encoder size. ``window`` = keys seen on each side; ``global_tokens`` leading global tokens."""

    vocab: int = 256
    layers: int = 2
    width: int = 128
    heads: int = 4
    seq_len: int = 256
    window: int = 16
    global_tokens: int = 2
    mlp_ratio: int = 4
    dtype: str = "float32"

    def __post_init__(self):
        _check(self)


def _check(cfg) -> None:
    for name in ("vocab", "layers", "width", "heads", "seq_len", "window", "mlp_ratio"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{type(cfg).__name__}.{name} must be a positive int, got {v!r}")
    if cfg.width % cfg.heads:
        raise ValueError(f"width ({cfg.width}) must be a multiple of heads ({cfg.heads})")
    if cfg.dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f'dtype must be "float32", "bfloat16" or "float16", got {cfg.dtype!r}')


def layer_masks(cfg: GPTConfig | LongformerConfig) -> list[masks.Mask]:
    """The splat mask of each layer."""
    if isinstance(cfg, GPTConfig):
        local = masks.causal() & masks.sliding_window(cfg.window - 1, 0)
        return [local if i % 2 == 0 else masks.causal() for i in range(cfg.layers)]
    m = masks.sliding_window(cfg.window) | masks.global_tokens(cfg.global_tokens)
    return [m] * cfg.layers


def make_batch(cfg, rng: np.random.Generator, batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens int32 [B, S], labels int32 [B, S], weights float32 [B, S]) for the model's task.

    GPT: induction (a random prefix repeated twice, next-token labels);
    Longformer: previous token (label ``i`` = token ``i - 1``; position 0 unweighted).
    """
    s = cfg.seq_len
    if isinstance(cfg, GPTConfig):
        half = (s + 2) // 2
        prefix = rng.integers(0, cfg.vocab, size=(batch, half))
        seq = np.concatenate([prefix, prefix], axis=1)[:, : s + 1]
        weights = np.ones((batch, s), np.float32)
        return seq[:, :-1].astype(np.int32), seq[:, 1:].astype(np.int32), weights
    tokens = rng.integers(0, cfg.vocab, size=(batch, s))
    labels = np.roll(tokens, 1, axis=1)
    weights = np.ones((batch, s), np.float32)
    weights[:, 0] = 0.0
    return tokens.astype(np.int32), labels.astype(np.int32), weights


def make_packed_batch(
    cfg: GPTConfig, rng: np.random.Generator, batch: int, *, eod: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Packed documents: (tokens int32 [B, S], labels int32 [B, S], weights float32 [B, S]).

    Each row is a run of documents cut at ``S`` tokens, each document an
    induction sequence (a random prefix of ``h`` tokens, ``h`` in ``[4, S // 4]``,
    repeated twice) ended by the token ``eod``, which appears nowhere else.
    Labels are the next tokens; a position whose label is the next document's
    first token (an ``eod``) has weight 0. With document-causal attention
    (:func:`examples.gpt_jax.document_ids`) every document is a sequence of its own.
    """
    if not (isinstance(cfg, GPTConfig) and 0 <= eod < cfg.vocab and cfg.seq_len >= 16):
        raise ValueError("make_packed_batch needs a GPTConfig with seq_len >= 16 and 0 <= eod < vocab")
    s = cfg.seq_len
    rows = []
    for _ in range(batch):
        row: list[int] = []
        while len(row) < s + 1:
            prefix = rng.integers(0, cfg.vocab - 1, size=rng.integers(4, s // 4 + 1))
            prefix = prefix + (prefix >= eod)  # skip the eod token
            row += [*prefix, *prefix, eod]
        rows.append(row[: s + 1])
    seq = np.asarray(rows, np.int32)
    tokens, labels = seq[:, :-1], seq[:, 1:]
    weights = (tokens != eod).astype(np.float32)
    return tokens, labels, weights
