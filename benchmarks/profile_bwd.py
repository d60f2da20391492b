#!/usr/bin/env python3
"""Launch splat's generated CUDA backward and FlashAttention-3's backward once each, for a profiler.

One H100/H200, bf16, B=1, H=16, D=128, one mask: the cuda forward (for ``out`` and ``lse``), the
cuda backward, then FA3's forward+backward (when ``flash_attn3_jax`` imports). Meant to run
under Nsight Compute with a kernel filter, e.g.::

    ncu --clock-control none --kernel-name-base demangled \\
        -k "regex:splat_bwd|FlashAttnBwdSm90" --set detailed \\
        python3 benchmarks/profile_bwd.py --mask full --length 8192
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
from profile_cases import MASKS, SCALE, D, H  # beside this script

from jax_bindings._cuda import backend as cb
from splat.tools import peers


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mask", choices=list(MASKS), default="full")
    p.add_argument("--length", type=int, default=8192)
    a = p.parse_args(argv)
    S = a.length
    layout = MASKS[a.mask].to_acsr(S, S)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(x, (1, S, H, D), jnp.bfloat16) for x in keys)
    out, lse = jax.jit(lambda q, k, v: cb.attention_fwd(q, k, v, None, layout, SCALE))(q, k, v)
    grads = jax.jit(lambda *x: cb.attention_bwd(*x[:3], None, *x[3:], layout, SCALE))(q, k, v, out, lse, do)
    jax.block_until_ready(grads)
    try:
        from flash_attn3_jax import flash_mha
    except ImportError:
        return 0
    kw = peers.flash_attn3_arguments(layout)
    if kw is None:  # a mask FA3 does not take
        return 0

    def fa3(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: flash_mha(q, k, v, softmax_scale=SCALE, **kw), q, k, v)
        return o, vjp(do)

    jax.block_until_ready(jax.jit(fa3)(q, k, v, do))
    return 0


if __name__ == "__main__":
    sys.exit(main())
