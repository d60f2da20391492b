"""Time a training step of the GPT example: splat attention vs dense attention.

Pure JAX (:mod:`examples.gpt_jax`, plain Adam): no flax or optax needed, so it
runs on a JAX newer than the installed flax supports. Every mode starts from
the same parameters and sees the same batches, so the loss curves agree up to
floating-point noise. Logs go to stderr; the last stdout line is one JSON
object: device, versions, config, per mode ``step_ms`` (median of the steady
steps), ``step_ms_min``, ``tokens_per_s``, ``first_step_s`` (compile + one step)
and ``losses`` (or ``error`` when that mode failed), ``ratio_vs_splat``
(mode step_ms / splat step_ms: > 1 means splat is faster) and the loss curves'
deviation from splat (``loss_dev``).

Modes (``--modes``, comma-separated; see :mod:`examples.gpt_jax`): splat,
cudnn_window (cuDNN's sliding window), cudnn_mask (cuDNN + dense boolean
window mask), xla, xla_mask. Default: splat,cudnn_mask,cudnn_window on GPU,
splat,xla elsewhere.

Default size is the GPU target: 12 layers, width 768, 12 heads, S=8192,
window 1024, bf16, batch 1, 50 steps. Tiny CPU run:

  python -m examples.bench_train --layers 2 --width 32 --heads 2 --seq-len 64 \
      --window 8 --dtype float32 --steps 4 --vocab 32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
import traceback

import jax
import numpy as np

from examples import gpt_jax
from examples.common import GPTConfig, make_batch


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "triton", "jax-triton"):
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


def run_mode(cfg: GPTConfig, mode: str, params_host, batches, *, lr: float) -> dict:
    """Train ``len(batches)`` steps from ``params_host``; per-step wall time and loss."""
    step = gpt_jax.make_train_step(cfg, mode, lr=lr)
    params = jax.device_put(params_host)
    opt_state = gpt_jax.adam_init(params)
    losses, times = [], []
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        params, opt_state, loss = jax.block_until_ready(step(params, opt_state, *batch))
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        if i == 0 or (i + 1) % 10 == 0 or i == len(batches) - 1:
            _log(f"[{mode}] step {i:3d}  loss {losses[-1]:.4f}  {1e3 * times[-1]:9.2f} ms")
    steady = times[2:] if len(times) > 3 else times[1:] or times
    step_s = float(np.median(steady))
    n_tokens = batches[0][0].size
    return {
        "step_ms": 1e3 * step_s,
        "step_ms_min": 1e3 * float(np.min(steady)),
        "tokens_per_s": n_tokens / step_s,
        "first_step_s": times[0],
        "losses": losses,
    }


def _loss_dev(a: list[float], b: list[float]) -> dict:
    a, b = np.asarray(a), np.asarray(b)
    return {
        "max_abs_dev": float(np.max(np.abs(a - b))),
        "max_rel_dev": float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-6))),
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
    ap.add_argument("--modes", default=None, help="comma list of " + ",".join(gpt_jax.ATTENTION_MODES))
    a = ap.parse_args(argv)
    platform_name = jax.default_backend()
    if a.modes is None:
        modes = ["splat", "cudnn_mask", "cudnn_window"] if platform_name == "gpu" else ["splat", "xla"]
    else:
        modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in gpt_jax.ATTENTION_MODES]
    if bad or not modes or a.steps < 1:
        ap.error(
            f"--modes must be a non-empty comma list of {gpt_jax.ATTENTION_MODES} (got {bad}), --steps >= 1"
        )
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
        "platform": platform_name,
        "versions": _versions(),
        "config": {**dataclasses.asdict(cfg), "batch": a.batch, "steps": a.steps, "lr": a.lr, "seed": a.seed},
        "modes": modes,
    }
    params_host = jax.device_get(gpt_jax.init_params(cfg, a.seed))
    rng = np.random.default_rng(a.seed)
    batches = [jax.device_put(make_batch(cfg, rng, a.batch)) for _ in range(a.steps)]
    results = {}
    for mode in modes:
        _log(f"[{mode}] compiling and running {a.steps} steps")
        try:
            results[mode] = run_mode(cfg, mode, params_host, batches, lr=a.lr)
        except (
            Exception
        ) as e:  # record and go on: one mode (e.g. a shape cuDNN refuses) must not stop the rest
            _log(traceback.format_exc())
            results[mode] = {"error": f"{type(e).__name__}: {e}"[:4000]}
        # a partial record on stderr, in case a time limit stops the run before the JSON line
        _log(f"[{mode}] result " + json.dumps({k: v for k, v in results[mode].items() if k != "losses"}))
    result["results"] = results
    ok = {m: r for m, r in results.items() if "error" not in r}
    if "splat" in ok:
        sp = ok["splat"]
        others = [m for m in ok if m != "splat"]
        result["ratio_vs_splat"] = {m: ok[m]["step_ms"] / sp["step_ms"] for m in others}
        result["loss_dev"] = {m: _loss_dev(sp["losses"], ok[m]["losses"]) for m in others}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
