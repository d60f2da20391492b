#!/usr/bin/env python3
"""Where the cuda backward's consumer warps spend a step, from Nsight Compute's warp-state samples.

Input: the SASS source page of one profiled ``splat_bwd_<digest>`` launch per mask, as CSV::

    ncu --clock-control none -k 'regex:^splat_bwd_[0-9a-f]{20}$' -c 1 \\
        --section WarpStateStats --section SourceCounters -f -o /tmp/rep \\
        python3 benchmarks/profile_bwd.py --mask block_local --length 8192
    ncu -i /tmp/rep.ncu-rep --page source --csv --print-source sass > sass_block_local.csv

The consumer warpgroups' code is the SASS between the two ``USETMAXREG`` instructions (the
producer's and the dQ writers' follow). Per mask this prints and writes:

* ``us_per_step``: the samples of the consumers' per-step instructions (executed once a step by
  each of the 8 consumer warps, or on every step but a few) by stall reason, and as
  ``unlisted`` the samples the page gives no reason column (all samples less the reasons': on
  H100, 7-8% of the consumers'), as a share of the consumer code's samples times
  the kernel's time (``KERNEL_US`` in the arguments, e.g. ncu's ``gpu__time_duration``), per
  step of a CTA (``steps / --sms``, one CTA an SM): a consumer warp's time in a step, split by
  what it waited on;
* ``branches``: the branch instructions in the consumer code, and ``no_inst`` samples in the step
  loop (instruction-cache misses);
* ``item_share``: the consumer samples outside the per-step code (item boundaries, tickets).

    python3 benchmarks/ncu_stalls.py block_local=sass_block_local.csv:15872:372 \\
        full=sass_full.csv:131072:2306 --device "NVIDIA H100 80GB HBM3" --out ncu-bwd-stalls.json
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import re
import sys

CONSUMER_WARPS = 8
ALL_SAMPLES = "Warp Stall Sampling (All Samples)"  # the page's column of every sample, reason or not


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def _rows(path: str) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    table = list(csv.reader(lines[1:]))  # line 0 names the kernel
    header = table[0]
    return [dict(zip(header, r, strict=True)) for r in table[1:] if len(r) == len(header)]


def summary(path: str, steps: int, kernel_us: float, sms: int = 132) -> dict:
    """The consumer warps' per-step stall split of one kernel's source-page CSV (module docstring)."""
    rows = _rows(path)
    reasons = [h for h in rows[0] if h.startswith("stall_") and "(Not" not in h]
    lo = next(i for i, r in enumerate(rows) if "USETMAXREG.TRY_ALLOC" in r["Source"])
    hi = next(i for i, r in enumerate(rows) if "USETMAXREG.DEALLOC" in r["Source"])
    consumer = rows[lo:hi]
    samples = sum(_num(r[ALL_SAMPLES]) for r in consumer)
    per_step = [r for r in consumer if _num(r["Instructions Executed"]) >= 0.9 * CONSUMER_WARPS * steps]
    by_reason = collections.Counter()
    for r in per_step:
        for h in reasons:
            by_reason[h.removeprefix("stall_")] += _num(r[h])
    # shares of one column: the reasons' columns do not add up to all samples
    step_samples = sum(_num(r[ALL_SAMPLES]) for r in per_step)
    by_reason["unlisted"] = step_samples - sum(by_reason.values())
    us_per_sample_step = kernel_us / (steps / sms) / samples
    return {
        "us_per_step": {k: round(v * us_per_sample_step, 4) for k, v in by_reason.most_common() if v},
        "us_per_step_total": round(step_samples * us_per_sample_step, 4),
        "item_share": round(1 - step_samples / samples, 4),
        "branches": sum(1 for r in consumer if re.search(r"\bBRA\b", r["Source"])),
        "no_inst_samples_in_steps": sum(_num(r["stall_no_inst"]) for r in per_step),
        "consumer_sass_instructions": len(consumer),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kernels", nargs="+",
                   help="NAME=CSV:STEPS:KERNEL_US (steps: a query block against a key block)")
    p.add_argument("--sms", type=int, default=132, help="the GPU's SMs (132: H100 and H200 SXM)")
    p.add_argument("--device", default="", help="the GPU the CSVs were profiled on, for the JSON")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    doc = {}
    for spec in a.kernels:
        name, rest = spec.split("=", 1)
        path, steps, us = rest.rsplit(":", 2)
        doc[name] = summary(path, int(steps), float(us), a.sms)
    names = list(doc)
    keys = sorted({k for d in doc.values() for k in d["us_per_step"]},
                  key=lambda k: -max(d["us_per_step"].get(k, 0) for d in doc.values()))
    print(f"{'us a step':18s}" + "".join(f"{n[:16]:>17s}" for n in names))
    for k in keys:
        print(f"{k:18s}" + "".join(f"{doc[n]['us_per_step'].get(k, 0):17.3f}" for n in names))
    for k in ("us_per_step_total", "item_share", "branches", "no_inst_samples_in_steps"):
        print(f"{k:18s}" + "".join(f"{doc[n][k]:17}" for n in names))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"schema": "splat-ncu-stalls/1", "device": a.device, "kernels": doc}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
