"""Train the example models on synthetic data and print loss and tokens/s.

Tasks (tokens from a seeded numpy rng, so runs are reproducible):

* GPT, *induction*: each sequence is a random prefix repeated twice; the model
  predicts the next token. The second half is predictable once attention
  reaches back half a sequence (the global layers), so the loss falls well
  below ``log(vocab)``.
* Longformer, *previous token*: the label at position ``i`` is token ``i - 1``
  (inside every window), a bidirectional encoder task.

Usage:
  python -m examples.train --model gpt --steps 100
  python -m examples.train --model longformer --layers 2 --seq-len 512 --attention dense
"""

from __future__ import annotations

import argparse
import json
import time

import flax.nnx as nnx
import jax
import numpy as np
import optax

from examples.common import make_batch
from examples.models import GPTConfig, LongformerConfig, build

__all__ = ["loss_fn", "main", "make_batch", "train", "train_step"]


def loss_fn(model, tokens, labels, weights):
    """Mean cross-entropy over weighted positions."""
    logits = model(tokens)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return (ce * weights).sum() / weights.sum()


@nnx.jit
def train_step(model, optimizer, tokens, labels, weights):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, labels, weights)
    optimizer.update(model, grads)
    return loss


def train(
    cfg, *, attention="splat", steps=100, batch=4, lr=3e-3, seed=0, dense_impl=None, log_every=10, quiet=False
):
    """Train a fresh model; returns ``{"losses": [...], "tokens_per_s": float, "step_s": float}``.

    ``tokens_per_s`` and ``step_s`` exclude the first (compiling) step.
    """
    model = build(cfg, attention, seed=seed, dense_impl=dense_impl)
    optimizer = nnx.Optimizer(model, optax.adamw(lr, weight_decay=0.0), wrt=nnx.Param)
    rng = np.random.default_rng(seed)
    losses, times = [], []
    for step in range(steps):
        tokens, labels, weights = make_batch(cfg, rng, batch)
        t0 = time.perf_counter()
        loss = float(jax.block_until_ready(train_step(model, optimizer, tokens, labels, weights)))
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if not quiet and (step % log_every == 0 or step == steps - 1):
            tps = batch * cfg.seq_len / times[-1]
            print(f"[{attention}] step {step:4d}  loss {loss:.4f}  {tps:,.0f} tokens/s", flush=True)
    steady = times[1:] or times
    step_s = float(np.median(steady))
    return {"losses": losses, "step_s": step_s, "tokens_per_s": batch * cfg.seq_len / step_s}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["gpt", "longformer"], default="gpt")
    ap.add_argument("--attention", choices=["splat", "dense"], default="splat")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--global-tokens", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    a = ap.parse_args(argv)
    common = dict(
        vocab=a.vocab, layers=a.layers, width=a.width, heads=a.heads, seq_len=a.seq_len, dtype=a.dtype
    )
    if a.model == "gpt":
        cfg = GPTConfig(window=a.window, **common)
    else:
        cfg = LongformerConfig(window=a.window, global_tokens=a.global_tokens, **common)
    res = train(cfg, attention=a.attention, steps=a.steps, batch=a.batch, lr=a.lr, seed=a.seed)
    summary = {
        "model": a.model,
        "attention": a.attention,
        "first_loss": res["losses"][0],
        "final_loss": res["losses"][-1],
        "step_s": res["step_s"],
        "tokens_per_s": res["tokens_per_s"],
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
