#!/usr/bin/env python3
"""The GPU timeline of splat's chained forward+backward on one mask: each kernel's time and the gaps.

One H100/H200, bf16, B=1, H=16, D=128, the cuda backend: ``--calls`` forward+backward calls chained
in one jitted program (as ``splat bench`` times them: ``out`` fed back as the next ``q``, ``dq``
as the next cotangent), run under ``jax.profiler`` ``--rounds`` times after two warm-up runs. From
the trace's busiest GPU stream, per round and over the calls between the program's first and
last (:func:`round_summary`): the time a call spans, each kernel's mean time a call (the forward,
the backward kernel, its passes, XLA's fusions and memsets), and the idle time between launches
by the pair of kernels around it::

    python3 benchmarks/profile_timeline.py --mask block_local --length 8192 [--out PATH]

Run it once with another revision first on ``PYTHONPATH`` to compare the two in one session.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import gzip
import json
import re
import sys
import tempfile

import jax
import jax.numpy as jnp
from profile_cases import MASKS, D, H  # beside this script

import splat
from splat.tools.timing import chain


def _kernel(name: str) -> str:
    """A kernel's name without the digest that makes each generated kernel's name unique."""
    return re.sub(r"_[0-9a-f]{20}$", "", name)


def _gpu_events(trace_dir: str) -> list[dict]:
    """The complete events of the busiest GPU stream in the newest trace under ``trace_dir``."""
    path = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1]
    events = json.load(gzip.open(path))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = [e for e in events if e.get("ph") == "X" and "GPU" in names.get(e["pid"], "")]
    stream, _ = collections.Counter((e["pid"], e["tid"]) for e in gpu).most_common(1)[0]
    return sorted((e for e in gpu if (e["pid"], e["tid"]) == stream), key=lambda e: e["ts"])


def round_summary(events: list[dict], calls: int) -> dict:
    """Per call: the span, each kernel's time and the gaps (us) of one round's events, over the
    calls between its first and its last. A call starts at its launch of the first kernel that
    runs once a call, and counts to the next call's start; the first call is left out with the
    host's start of the program on an idle GPU before it (30-80 us, NOTES session 26), and the
    last with its tail: ``calls - 2`` calls, from the second call's start to the last one's."""
    names = [_kernel(e["name"]) for e in events]
    counts = collections.Counter(names)
    once = next((n for n in names if counts[n] == calls), None)
    if calls < 3 or once is None:
        raise ValueError(f"round_summary needs 3 or more calls, one kernel launched once a call; got {calls} "
                         f"calls and launches {dict(counts)}")
    starts = [i for i, name in enumerate(names) if name == once]
    first, last, n = starts[1], starts[-1], calls - 2
    kernels, gaps = collections.defaultdict(float), collections.defaultdict(float)
    for i in range(first, last):
        kernels[names[i]] += events[i]["dur"] / n
        idle = events[i + 1]["ts"] - events[i]["ts"] - events[i]["dur"]
        gaps[f"{names[i]} -> {names[i + 1]}"] += idle / n
    return {"us_per_call": (events[last]["ts"] - events[first]["ts"]) / n, "kernels_us": dict(kernels),
            "gaps_us": dict(gaps), "launches_per_call": (last - first) / n}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mask", choices=list(MASKS), default="block_local")
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--calls", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    S, mask = a.length, MASKS[a.mask]
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(x, (1, S, H, D), jnp.bfloat16) for x in keys)

    def fwd_bwd(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: splat.attention(q, k, v, mask=mask, backend="cuda"), q, k, v)
        return out, vjp(do)

    program = jax.jit(chain(fwd_bwd, a.calls, {0: 0, 3: 1}))
    for _ in range(2):
        jax.block_until_ready(program(q, k, v, do))
    rounds = []
    for _ in range(a.rounds):
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d):
                jax.block_until_ready(program(q, k, v, do))
            rounds.append(round_summary(_gpu_events(d), a.calls))
    for r in rounds:
        print(f"{r['us_per_call']:8.1f} us a call, {r['launches_per_call']:.1f} launches")
    last = rounds[-1]
    for name, us in sorted(last["kernels_us"].items(), key=lambda x: -x[1]):
        print(f"  {us:8.2f} us  {name}")
    for name, us in sorted(last["gaps_us"].items(), key=lambda x: -x[1])[:8]:
        print(f"  {us:8.2f} us  gap {name}")
    if a.out:
        record = {"schema": "splat profile_timeline v1", "device": jax.devices()[0].device_kind,
                  "date": datetime.date.today().isoformat(),
                  "settings": vars(a) | {"H": H, "D": D, "dtype": "bfloat16"}, "rounds": rounds}
        with open(a.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
