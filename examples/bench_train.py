"""Time a training step of the GPT example with splat vs dense attention.

Both runs start from the same parameters and see the same batches, so their
loss curves should agree up to floating-point noise. Prints one JSON object:
device, versions, config, per-run step time / tokens/s / compile time / losses,
the dense/splat step-time ratio (>1 = splat faster) and the loss curves'
maximum deviation.

Default size is the GPU target: 12 layers, width 768, 12 heads, S=8192,
window 1024, bf16, batch 1; dense = ``jax.nn.dot_product_attention`` with
cuDNN on GPU (``--dense-impl``), XLA elsewhere. Tiny CPU run:

  python -m examples.bench_train --layers 2 --width 64 --heads 2 --seq-len 128 \
      --window 16 --dtype float32 --steps 5
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import flax.nnx as nnx
import jax
import numpy as np
import optax

from examples.models import GPTConfig, build
from examples.train import make_batch, train_step


def _versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("jax", "jaxlib", "flax", "optax", "triton", "jax-triton", "splat"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    try:
        import splat

        out["splat"] = splat.__version__
    except Exception:  # report what there is; a version lookup must not stop a benchmark
        pass
    return out


def run(cfg: GPTConfig, attention: str, *, steps: int, batch: int, lr: float, seed: int, dense_impl) -> dict:
    """Train ``steps`` steps; per-step wall times (block_until_ready) and losses."""
    model = build(cfg, attention, seed=seed, dense_impl=dense_impl)
    optimizer = nnx.Optimizer(model, optax.adamw(lr, weight_decay=0.0), wrt=nnx.Param)
    rng = np.random.default_rng(seed)
    losses, times = [], []
    for _ in range(steps):
        tokens, labels, weights = (jax.device_put(x) for x in make_batch(cfg, rng, batch))
        t0 = time.perf_counter()
        loss = jax.block_until_ready(train_step(model, optimizer, tokens, labels, weights))
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    steady = times[2:] if len(times) > 3 else times[1:] or times
    step_s = float(np.median(steady))
    return {
        "step_ms": 1e3 * step_s,
        "step_ms_min": 1e3 * float(np.min(steady)),
        "tokens_per_s": batch * cfg.seq_len / step_s,
        "first_step_s": times[0],
        "losses": losses,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--dense-impl", choices=["auto", "xla", "cudnn"], default="auto")
    ap.add_argument("--only", choices=["both", "splat", "dense"], default="both")
    a = ap.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    impl = a.dense_impl
    if impl == "auto":
        impl = "cudnn" if on_gpu and a.dtype != "float32" else "xla"
    cfg = GPTConfig(
        vocab=a.vocab,
        layers=a.layers,
        width=a.width,
        heads=a.heads,
        seq_len=a.seq_len,
        window=a.window,
        dtype=a.dtype,
    )
    dev = jax.devices()[0]
    result = {
        "benchmark": "examples.bench_train",
        "device": getattr(dev, "device_kind", str(dev)),
        "platform": jax.default_backend(),
        "versions": _versions(),
        "config": {**cfg.__dict__, "batch": a.batch, "steps": a.steps, "lr": a.lr, "dense_impl": impl},
    }
    modes = ["splat", "dense"] if a.only == "both" else [a.only]
    for mode in modes:
        result[mode] = run(cfg, mode, steps=a.steps, batch=a.batch, lr=a.lr, seed=a.seed, dense_impl=impl)
    if a.only == "both":
        ls, ld = np.array(result["splat"]["losses"]), np.array(result["dense"]["losses"])
        result["speedup_dense_over_splat"] = result["dense"]["step_ms"] / result["splat"]["step_ms"]
        result["loss_max_abs_dev"] = float(np.max(np.abs(ls - ld)))
        result["loss_max_rel_dev"] = float(np.max(np.abs(ls - ld) / np.maximum(np.abs(ld), 1e-6)))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
