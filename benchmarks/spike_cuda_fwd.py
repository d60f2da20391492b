#!/usr/bin/env python3
"""Spike: what a CUDA C++ (wgmma) forward gives against FlashAttention-3, cuDNN and splat's Triton.

The second half of issue 10's route spike (the Triton half: ``spike_hopper_fwd.py``). The kernel
is ``jax_bindings._cuda.source.source`` (read its docstring), built as the cuda backend builds it
(NVRTC, else nvcc) for sm_90a on the GPU machine, loaded with CuPy and launched on torch's
stream; the peers are the Triton spike's (``flash_attn3_jax.flash_mha``, cuDNN through
``jax.nn.dot_product_attention``, and ``splat.attention(backend="triton")``), each timed as 10
calls chained in one jitted program.

Each build is first checked against a float32 torch reference at B=1, H=2 (GQA 2:1 too) on
lengths that are and are not multiples of 128, and on a causal window narrower than a tile;
every consumer schedule (``SCHEDULES``) and ring depth is built, checked and timed.

    python3 benchmarks/spike_cuda_fwd.py [--lengths 8192,16384] [--windows 0,1024] [--out PATH]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import spike_hopper_fwd as sh  # noqa: E402

from jax_bindings._cuda import plan  # noqa: E402
from jax_bindings._cuda import source as cfs  # noqa: E402

LOG2E = sh.LOG2E
SCHEMA = "splat-spike-cuda-fwd/1"


def build(src: str, name: str, workdir: str) -> dict:
    """The source compiled as the cuda backend compiles it (``jax_bindings._cuda.compiler``: NVRTC,
    else nvcc) for sm_90a, the kernel named after the source; returns the cubin's path, the kernel
    name and ptxas's register / spill report."""
    from jax_bindings._cuda import compiler

    c = compiler.compiler()
    if isinstance(c, str):
        raise RuntimeError(c)
    kernel, src = cfs.with_unique_name(src)
    t0 = time.perf_counter()
    image, log = c.compile(src, verbose=True)
    keep = ("registers", "spill", "warning")
    report = [ln.strip() for ln in log.splitlines() if any(x in ln.lower() for x in keep)]
    cubin = os.path.join(workdir, name + ".cubin")
    with open(cubin, "wb") as f:
        f.write(image)
    return {"build_s": round(time.perf_counter() - t0, 2), "ptxas": report, "compiler": c.kind,
            "cubin": cubin, "kernel": kernel}


def jax_kernel(cubin: str, kernel: str, stages: int, block_n: int):
    """The built kernel as a JAX callable ``(q, k, v, scale) -> (out, lse)``, launched as the cuda
    backend launches its own (``jax_bindings._cuda.backend.run_forward``: jaxlib's kernel call
    with the cubin as its module image); the tensor-map templates are encoded at trace time."""
    from jax_bindings._cuda import backend, plan

    with open(cubin, "rb") as f:
        image = f.read()
    smem = cfs.smem_bytes(stages, block_n)

    def attention(q, k, v, scale):
        grid = plan.grid(q.shape, "grid", 0)
        maps = plan.tensor_maps(block_n, q.shape, k.shape, v.shape)
        return backend.run_forward(kernel, image, grid, smem, maps, q, k, v, scale)

    return attention


class Kernel:
    """One built variant, launched through CuPy on torch's current stream."""

    def __init__(self, cubin: str, kernel: str, stages: int, block_n: int):
        import cupy as cp

        self.cp = cp
        self.fn = cp.RawModule(path=cubin).get_function(kernel)
        self.smem = cfs.smem_bytes(stages, block_n)
        self.block_n = block_n
        self.fn.max_dynamic_shared_size_bytes = self.smem
        self.maps: dict = {}
        self.sem = None

    def _maps(self, q, k, v, ctas: int, torch):
        key = (tuple(q.shape), tuple(k.shape), tuple(v.shape), ctas)
        if key not in self.maps:
            bn = self.block_n
            tmpl = plan.tensor_maps(bn, q.shape, k.shape, v.shape)
            t = torch.frombuffer(bytearray(tmpl), dtype=torch.uint8).cuda()
            self.maps[key] = (t, torch.zeros(ctas * cfs.SLOT_BYTES, dtype=torch.uint8, device="cuda"))
        return self.maps[key]

    def _sem(self, torch):
        """The kernel's ticket counter, zeroed for each launch (unused by the grid schedule)."""
        if self.sem is None:
            self.sem = torch.zeros(1, dtype=torch.int32, device="cuda")
        return self.sem.zero_()

    def __call__(self, q, k, v, o, lse, scale: float, torch):
        B, Sq, H, D = q.shape
        Skv, Hkv = k.shape[1], k.shape[2]
        stream = self.cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        grid = plan.grid(q.shape, "grid", 0)
        templates, slots = self._maps(q, k, v, grid[0] * grid[1] * grid[2], torch)
        args = tuple(np.uint64(t.data_ptr()) for t in (q, k, v, templates))
        args += (np.int32(Sq), np.int32(Skv), np.int32(H), np.int32(Hkv), np.int32(B),
                 np.float32(scale * LOG2E))
        args += tuple(np.uint64(t.data_ptr()) for t in (o, lse, self._sem(torch), slots))
        self.fn(grid, (cfs.THREADS,), args, shared_mem=self.smem, stream=stream)


def reference(q, k, v, left, right, scale, torch):
    """Float32 ``(out, lse)`` for ``i - left <= j <= i + right``, GQA by repeating k/v heads."""
    rep = q.shape[2] // k.shape[2]
    kf, vf = (x.float().repeat_interleave(rep, dim=2).transpose(1, 2) for x in (k, v))
    qf = q.float().transpose(1, 2)
    s = (qf @ kf.transpose(-1, -2)) * scale
    r = torch.arange(q.shape[1], device=q.device)[:, None]
    c = torch.arange(k.shape[1], device=q.device)[None, :]
    keep = torch.ones_like(r + c, dtype=torch.bool)
    if left is not None:
        keep &= c >= r - left
    if right is not None:
        keep &= c <= r + right
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ vf).transpose(1, 2), lse


CHECKS = [  # (Sq, Skv, H, Hkv)
    (1664, 1664, 2, 2),
    (1000, 1000, 4, 2),
    (300, 700, 2, 1),
]


def check(kern: Kernel, left, right, torch) -> dict:
    worst = {"out": 0.0, "lse": 0.0}
    for Sq, Skv, H, Hkv in CHECKS:
        g = torch.Generator(device="cuda").manual_seed(Sq + Skv)
        q = torch.randn((1, Sq, H, 128), device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn((1, Skv, Hkv, 128), device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn((1, Skv, Hkv, 128), device="cuda", dtype=torch.bfloat16, generator=g)
        k[:, Skv // 2 :: 41] *= 4.0
        o = torch.full_like(q, float("nan"))
        lse = torch.full((1, H, Sq), float("nan"), device="cuda")
        kern(q, k, v, o, lse, 128**-0.5, torch)
        torch.cuda.synchronize()
        ro, rl = reference(q, k, v, left, right, 128**-0.5, torch)
        worst["out"] = max(worst["out"], float((o.float() - ro).abs().max().nan_to_num(99.0)))
        finite = torch.isfinite(rl)
        lerr = (lse - rl).abs()[finite].max() if finite.any() else torch.tensor(0.0)
        bad_inf = bool((lse[~finite] != rl[~finite]).any())
        worst["lse"] = max(worst["lse"], float(lerr.nan_to_num(99.0)), 99.0 if bad_inf else 0.0)
    worst["ok"] = worst["out"] < sh.TOLERANCE and worst["lse"] < sh.TOLERANCE
    return worst


SCHEDULES = {  # consumer schedules and K/V feeds (jax_bindings._cuda.source.source flags)
    "serial": dict(overlap=False, pingpong=False),
    "overlap": dict(overlap=True, pingpong=False),
    "pingpong": dict(overlap=False, pingpong=True),
    "overlap+pingpong": dict(overlap=True, pingpong=True),
    "overlap+pingpong,cp.async": dict(overlap=True, pingpong=True, feed="cp.async"),
    "serial,cp.async": dict(overlap=False, pingpong=False, feed="cp.async"),
}
EXPERIMENTS = {  # timing only: their output is not attention, so they skip the check
    "overlap+pingpong,no-load": dict(overlap=True, pingpong=True, feed="none"),
    "serial,no-load": dict(overlap=False, pingpong=False, feed="none"),
    "overlap+pingpong,cp.async,no-fence": dict(
        overlap=True, pingpong=True, feed="cp.async", proxy_fence=False
    ),
}


def mask_of(window: int):
    """Spike window convention (0: dense; W: causal window of W keys) -> (left, right)."""
    return (None, None) if window == 0 else (window - 1, 0)


def build_and_check(window: int, stages: int, block_n: int, sched: str, workdir: str, torch) -> dict:
    left, right = mask_of(window)
    name = f"{sched}_s{stages}_n{block_n}"
    rec = {"name": name, "window": window, "stages": stages, "block_n": block_n, "schedule": sched}
    try:
        src = cfs.source(left, right, stages=stages, block_n=block_n, **{**SCHEDULES, **EXPERIMENTS}[sched])
        rec.update(build(src, f"w{window}_{name}".replace(",", "_").replace("+", "_"), workdir))
        if sched in EXPERIMENTS:
            Kernel(rec["cubin"], rec["kernel"], stages, block_n)  # loads
            rec.update(ok=True, unchecked="timing experiment: the output is not attention")
        else:
            rec.update(check(Kernel(rec["cubin"], rec["kernel"], stages, block_n), left, right, torch))
    except Exception as e:  # noqa: BLE001 -- recorded, the spike goes on
        rec.update(ok=False, error=sh._first_line(e))
    return rec


def checked_builds(specs: list[tuple[int, int, int, str]], workdir: str, per_build_s: float = 30.0):
    """Builds and checks run in child processes: a kernel that hangs (a barrier never completes)
    is recorded as such after ``per_build_s`` and the rest go on in a fresh child."""
    pending = list(specs)
    while pending:
        arg = "|".join("/".join(map(str, spec)) for spec in pending)
        cmd = [sys.executable, os.path.abspath(__file__), "--check-builds", arg, "--workdir", workdir]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30 + per_build_s * len(pending))
            lines, hung = r.stdout, False
        except subprocess.TimeoutExpired as e:
            out = e.stdout or b""
            lines, hung = out.decode() if isinstance(out, bytes) else out, True
        done = [json.loads(ln) for ln in lines.splitlines() if ln.startswith("{")]
        yield from done
        pending = pending[len(done):]
        if pending and (hung or not done):
            w, st, bn, sc = pending.pop(0)
            why = "hang: no result before the child's time limit" if hung else "child died without a result"
            yield {"name": f"{sc}_s{st}_n{bn}", "window": w, "stages": st, "block_n": bn, "schedule": sc,
                   "ok": False, "error": why}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=sh._csv(int), default=[8192, 16384])
    p.add_argument("--windows", type=sh._csv(int), default=[0, 1024])
    p.add_argument("--stages", type=sh._csv(int), default=[2, 3])
    p.add_argument("--block-n", type=sh._csv(int), default=[128], help="keys per tile")
    p.add_argument("--schedules", type=lambda x: x.split(";"), default=list(SCHEDULES),
                   help=f"';'-separated, of {list(SCHEDULES) + list(EXPERIMENTS)}")
    p.add_argument("--peers", type=sh._csv(str), default=["fa3", "cudnn", "splat"])
    p.add_argument("--jax-schedules", type=lambda x: x.split(";"), default=["overlap+pingpong"],
                   help="builds of these schedules are also timed launched from JAX")
    p.add_argument("--out", default=None)
    p.add_argument("--check-builds", default=None, help=argparse.SUPPRESS)  # child: "w,stages,sched;..."
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    import torch

    if a.check_builds:
        for spec in a.check_builds.split("|"):
            w, st, bn, sc = spec.split("/")
            print(json.dumps(build_and_check(int(w), int(st), int(bn), sc, a.workdir, torch)), flush=True)
        return 0

    dev = torch.cuda.get_device_name()
    out_path = a.out or os.path.join(HERE, "results", f"spike-cuda-fwd-{sh._slug(dev)}.json")
    doc = {"schema": SCHEMA, "date": datetime.datetime.now().isoformat(timespec="seconds"), "device": dev,
           "versions": sh._versions(), "settings": {"B": 1, "H": 16, "D": 128, "lengths": a.lengths,
                                                    "windows": a.windows, "dtype": "bfloat16"},
           "flop_formula": sh.FLOP_FORMULA, "builds": [], "rows": []}
    workdir = tempfile.mkdtemp(prefix="splat-cuda-")
    fake = types.SimpleNamespace(torch=torch, args=types.SimpleNamespace(batch=1, heads=16, head_dim=128))
    jax_fns = {}  # "jax:<build>" -> JAX callable, per window

    def peer_fn(name, window):
        if name.startswith("jax:"):
            attention = jax_fns[(window, name)]
            return lambda q, k, v: attention(q, k, v, 128**-0.5)
        return sh.Bench._peer_fn(fake, name, window)

    fake._peer_fn = peer_fn

    def write():
        os.makedirs(os.path.dirname(out_path), exist_ok=True)
        with open(out_path, "w") as f:
            json.dump(doc, f, indent=1)

    specs = [(w, st, bn, sc) for w in a.windows for st in a.stages for bn in a.block_n for sc in a.schedules
             if cfs.smem_bytes(st, bn) <= cfs.SMEM_LIMIT]
    kernels = {}  # (window, variant name) -> Kernel
    for rec in checked_builds(specs, workdir):
        doc["builds"].append(rec)
        write()
        shown = {x: rec.get(x) for x in ("ok", "out", "lse", "error", "ptxas")}
        sh._log(f"build w{rec['window']} {rec['name']}: {json.dumps(shown)}")
        if rec.get("ok"):
            kernels[(rec["window"], rec["name"])] = Kernel(rec["cubin"], rec["kernel"], rec["stages"],
                                                           rec["block_n"])
            if rec["schedule"] in a.jax_schedules:
                try:
                    fn = jax_kernel(rec["cubin"], rec["kernel"], rec["stages"], rec["block_n"])
                    jax_fns[(rec["window"], "jax:" + rec["name"])] = fn
                except Exception as e:  # noqa: BLE001 -- recorded, the spike goes on
                    rec["jax_error"] = sh._first_line(e)
                    sh._log(f"jax launcher for {rec['name']}: {rec['jax_error']}")

    for S in a.lengths:
        q, k, v = sh.Bench.inputs(types.SimpleNamespace(torch=torch, args=fake.args), S, 1000 + S)
        for window in a.windows:
            state: dict = {}
            flops = sh.useful_flops(1, 16, S, 128, window)
            for (w, name), kern in kernels.items():
                if w != window:
                    continue
                o = torch.empty_like(q)
                lse = torch.empty((1, 16, S), device="cuda", dtype=torch.float32)
                fn = functools.partial(kern, q, k, v, o, lse, 128**-0.5, torch)
                row = {"kind": "cuda", "name": name, "mask": sh._mask_name(window), "S": S}
                row.update(sh.time_cuda(fn, torch))
                fn()
                torch.cuda.synchronize()
                if "ref_out" not in state:
                    state["ref_out"], state["ref_name"] = o.clone(), name
                row["tflops"] = flops / row["ms"] * 1e-9
                doc["rows"].append(row)
                write()
                sh._log(f"{row['mask']:>20} S={S} {name:<28} {row['tflops']:7.1f} TFLOP/s {row['ms']:.4f} ms")
            jax_names = [n for (w, n) in jax_fns if w == window]
            for peer in [*jax_names, *a.peers]:
                row = sh.Bench.peer_row(fake, peer, window, S, q, k, v, state)
                doc["rows"].append(row)
                write()
                sh._log(f"{row['mask']:>20} S={S} {peer:<28} {row.get('tflops', 0):7.1f} TFLOP/s "
                        f"diff {row.get('max_abs_diff_vs_first')} {row.get('error', '')}")
    # summary: ratios of the best CUDA build to each peer
    table = []
    for S in a.lengths:
        for window in a.windows:
            mask = sh._mask_name(window)
            here = [r for r in doc["rows"] if r["S"] == S and r["mask"] == mask and "ms" in r]
            refs = {r["name"]: r for r in here if r["name"] in a.peers}
            checked = [r for r in here if r["kind"] == "cuda" and "no-load" not in r["name"]]
            launched = [r for r in here if r["name"].startswith("jax:")]
            for label, rows in (("cuda (cupy launch)", checked), ("cuda (JAX, chained)", launched)):
                if not rows:
                    continue
                best = min(rows, key=lambda r: r["ms"])
                rec = {"mask": mask, "S": S, "route": label, "build": best["name"],
                       "tflops": round(best["tflops"], 1)}
                for name, r in refs.items():
                    rec[f"{name}_tflops"] = round(r["tflops"], 1)
                    rec[f"x_{name}"] = round(r["ms"] / best["ms"], 3)
                table.append(rec)
    doc["table"] = table
    write()
    for rec in table:
        print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
