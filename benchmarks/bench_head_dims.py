"""Head dims other than 128 and the soft cap: splat against cuDNN and FlexAttention, on one GPU.

The cases of the CUDA target's head dims (bf16, B = 1, H = 16): causal at D = 64, 192 and 256 and
a causal window of 1024 at D = 64 and 256 against cuDNN; a sliding window (256, 256) at D = 64,
128, 192 and 256 against FlexAttention (the share of splat's D = 128 rate the others keep); the Gemma-2 local
layer (a causal window of 4096, soft cap 50, D = 256, H = 16, Hk = 8) against FlexAttention with
the cap as its ``score_mod``; forward and forward+backward, at S = 8192 and 16384. Every peer of
a row runs in this process, sampled in interleaved rounds (:data:`splat.tools.timing.INTERLEAVING`);
useful TFLOP/s count the mask's pairs (:func:`splat.tools.bench.useful_flops`). Which backend runs
splat's forward and backward is recorded per row.

``--tiles`` times instead the forward kernel at each key tile the head dim's shared memory holds
(:mod:`jax_bindings._cuda.tile_shapes`), the numbers its table rests on.

    python benchmarks/bench_head_dims.py [--lengths 8192 16384] [--out F.json]
    python benchmarks/bench_head_dims.py --tiles
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import re
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from splat import masks  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    mask: object
    head_dim: int
    heads: int = 16
    kv_heads: int = 16
    soft_cap: float | None = None
    peers: tuple[str, ...] = ("cudnn", "flex")


CAUSAL_WINDOW_1024 = masks.sliding_window(1023, 0)
SLIDING_256 = masks.sliding_window(256, 256)
CASES = [
    *(Case(f"causal_d{d}", masks.causal(), d) for d in (64, 192, 256)),
    *(Case(f"causal_window_1024_d{d}", CAUSAL_WINDOW_1024, d) for d in (64, 256)),
    *(Case(f"sliding_window_256_d{d}", SLIDING_256, d, peers=("flex",)) for d in (64, 128, 192, 256)),
    Case("gemma2_local", masks.sliding_window(4095, 0), 256, 16, 8, 50.0, ("flex",)),
]


def _problem(case: Case, s: int, mode: str):
    from splat.tools import peers

    rng = np.random.default_rng(0)
    shape = (1, s, case.heads, case.head_dim)
    kv = (1, s, case.kv_heads, case.head_dim)
    q, do = (rng.standard_normal(shape, np.float32) for _ in range(2))
    k, v = (rng.standard_normal(kv, np.float32) for _ in range(2))
    return peers.Problem(q, k, v, do, case.mask, case.mask.to_acsr(s), "bfloat16", mode, per_sample=10)


def _splat(case: Case, problem, backend: str = "auto"):
    """splat.attention on ``backend``; ``splat_backend``: the backend that runs its forward."""
    import splat
    from splat.tools import peers

    x = peers._abstract(problem)
    ran = peers.splat_backend("attention", x, x, x, problem.layout, case.head_dim**-0.5, backend=backend,
                              soft_cap=case.soft_cap)

    def attend(q, k, v):
        return splat.attention(q, k, v, mask=case.mask, logits_soft_cap=case.soft_cap, backend=backend)

    return dataclasses.replace(peers._compile_jax(attend, problem), splat_backend=ran)


def _peer(name: str, case: Case, problem):
    from splat.tools import peers

    if name == "cudnn":
        return peers._prep_cudnn(problem)
    if name == "flex":
        return peers._prep_flex(problem, case.soft_cap)
    raise ValueError(f"unknown peer {name!r}")


def run(cases, lengths, modes, warmup: int, repeats: int, save=lambda rows: None) -> list[dict]:
    from splat.tools import bench, timing
    from splat.tools.peers import PeerUnavailable

    rows = []
    for case in cases:
        for s in lengths:
            for mode in modes:
                problem = _problem(case, s, mode)
                prepared = {"splat": _splat(case, problem)}
                notes = {}
                # splat's own kernels where "auto" hands the call to another backend
                if prepared["splat"].splat_backend != "cuda":
                    try:
                        cuda = _splat(case, problem, "cuda")
                        cuda.run()
                        prepared["splat_cuda"] = cuda
                    except (NotImplementedError, PeerUnavailable) as e:
                        notes["splat_cuda"] = f"{type(e).__name__}: {e}"
                for peer in case.peers:
                    try:
                        prepared[peer] = _peer(peer, case, problem)
                    except PeerUnavailable as e:
                        notes[peer] = str(e)
                samplers = {n: x.sampler(10, 20.0) for n, x in prepared.items()}
                times, errors = timing.time_interleaved(samplers, warmup, repeats)
                notes.update({n: f"{type(e).__name__}: {e}" for n, e in errors.items()})
                names = [n for n in prepared if n in times]
                flops = bench.useful_flops(1, case.heads, problem.layout.nnz, case.head_dim, mode)
                row = {"case": case.name, "S": s, "mode": mode, "head_dim": case.head_dim,
                       "heads": case.heads, "kv_heads": case.kv_heads, "soft_cap": case.soft_cap,
                       "splat_backend": prepared["splat"].splat_backend, "unavailable": notes, "impls": {}}
                for n in names:
                    row["impls"][n] = {"ms": times[n]["ms"], "tflops": flops / times[n]["ms"] / 1e9}
                for own in ("splat", "splat_cuda"):  # each peer's time over splat's (>1: splat faster)
                    for n in names:
                        if not n.startswith("splat") and own in times:
                            row[f"x_{n}" + own[5:]] = row["impls"][n]["ms"] / row["impls"][own]["ms"]
                rows.append(row)
                save(rows)
                print(_line(row), flush=True)
    return rows


def _line(row: dict) -> str:
    impls = "  ".join(f"{n} {v['ms']:.3f} ms {v['tflops']:.0f} TF" for n, v in row["impls"].items())
    ratios = "  ".join(f"{k} {v:.2f}" for k, v in row.items() if k.startswith("x_"))
    return f"{row['case']:26s} S={row['S']:5d} {row['mode']:6s} [{row['splat_backend']}]  {impls}  {ratios}"


def tiles(lengths, warmup: int, repeats: int) -> list[dict]:
    """The forward kernel at each key tile that fits, per head dim, on a band and on long rows."""
    import jax
    import jax.numpy as jnp

    from jax_bindings._cuda import backend as cb
    from jax_bindings._cuda import plan, source
    from splat.tools import bench, timing

    rows = []
    for d, candidates in ((64, (128, 176, 192)), (192, (64, 96, 112)), (256, (48, 64, 80))):
        for mask_name, mask in (("causal", masks.causal()), ("causal_window_1024", CAUSAL_WINDOW_1024),
                                ("sliding_window_256", SLIDING_256)):
            for s in lengths:
                layout = mask.to_acsr(s)
                rng = np.random.default_rng(0)
                q, k, v = (jnp.asarray(rng.standard_normal((1, s, 16, d)), jnp.bfloat16) for _ in range(3))
                planned = plan.fwd_variant(layout, d, "bfloat16")
                samplers = {}
                for bn in candidates:
                    variant = plan.with_two_q_tiles(dataclasses.replace(planned, block_n=bn, q_stages=1))
                    if variant.smem > source.SMEM_LIMIT:
                        continue

                    def fn(q, k, v, variant=variant, d=d):
                        name, image = plan.compiled(variant)
                        grid = plan.grid(q.shape, variant.schedule, cb._sm_count())
                        maps = plan.tensor_maps(variant.block_n, q.shape, k.shape, v.shape)
                        return cb.run_forward(name, image, grid, variant.smem, maps, q, k, v, d**-0.5,
                                              zero_ticket=source.takes_tickets(variant.schedule))[0]

                    _, launch, sync = timing.compile_timed(jax.jit(fn), (q, k, v), 10, {0: 0})
                    samplers[(bn, variant.q_stages)] = timing.Sampler(
                        None, launch=launch, sync=sync, per_sample=10, calls_per_launch=10,
                        min_sample_ms=20.0)
                times, errors = timing.time_interleaved(samplers, warmup, repeats)
                for key, e in errors.items():
                    print(f"d={d} {mask_name} S={s} bn={key[0]}: {type(e).__name__}: {e}", flush=True)
                flops = bench.useful_flops(1, 16, layout.nnz, d, "fwd")
                for (bn, qs), t in times.items():
                    row = {"head_dim": d, "mask": mask_name, "S": s, "block_n": bn, "q_stages": qs,
                           "planned": bn == planned.block_n, "ms": t["ms"], "tflops": flops / t["ms"] / 1e9}
                    rows.append(row)
                    print(f"d={d} {mask_name:20s} S={s} bn={bn:3d} qs={qs} {t['ms']:.3f} ms "
                          f"{row['tflops']:.0f} TF{'  (planned)' if row['planned'] else ''}", flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", nargs="+", type=int, default=[8192, 16384])
    p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"])
    p.add_argument("--cases", nargs="+", default=None)
    p.add_argument("--tiles", action="store_true")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from splat.tools import bench, timing

    env = bench.environment()
    kind = "head-dim-tiles" if args.tiles else "head-dims"
    device = re.sub(r"[^A-Za-z0-9]+", "-", env["device"]).strip("-").lower()
    out = args.out or os.path.join(HERE, "results", f"{kind}-{device}-{dt.date.today().isoformat()}.json")

    def save(rows):  # after each row: a run cut short keeps what it measured
        result = {"environment": env, "timing": timing.TIMING_METHOD, "interleaving": timing.INTERLEAVING,
                  "tiles" if args.tiles else "rows": rows}
        with open(out, "w") as f:
            json.dump(result, f, indent=1, default=str)

    if args.tiles:
        save(tiles(args.lengths, args.warmup, args.repeats))
    else:
        cases = [c for c in CASES if args.cases is None or c.name in args.cases]
        save(run(cases, args.lengths, args.modes, args.warmup, args.repeats, save))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
