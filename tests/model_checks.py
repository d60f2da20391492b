"""Shared checks of the library integration tests (tests/test_models_*.py).

Each model is built from its library's own config at a small size (2 layers, width 128, 4 query
and 2 KV heads of dim 32, sequence 64, random weights) and run three ways, with and without
``splat.sparsify``: forward, ``jax.grad`` of a loss with respect to the parameters, and KV-cache
decode. Every check asserts float32 error <= 1e-5 (relative to the largest value) against the
library's own result, no fallback warning, and -- through :func:`splat.call_log` -- that splat
ran every attention layer of every call (``replaced == layers``, nothing left dense) and, for
decode steps, splat's decode path (queries at positions known only at run time); and, through
:func:`splat.guard_log`, that every run-time check of positions chose splat's attention when
the compiled step ran.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

import splat

LAYERS, WIDTH, HEADS, KV_HEADS, HEAD_DIM, SEQ, VOCAB = 2, 128, 4, 2, 32, 64, 97
TOL = 1e-5


def tokens(batch: int = 2, seq: int = SEQ, seed: int = 0) -> jax.Array:
    """Random token ids in ``[1, VOCAB)`` (0 is the pad id of most libraries)."""
    return jnp.asarray(np.random.default_rng(seed).integers(1, VOCAB, (batch, seq)), jnp.int32)


def close(got, want) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        scale = max(1.0, float(np.abs(w).max()))
        err = float(np.abs(g - w).max()) / scale
        assert err <= TOL, f"error {err:.3g} > {TOL} (relative to max |want| = {scale:.3g})"


def run_splat(fn, *args, layers: int, decode: bool):
    """``jit(sparsify(fn))(*args)``, asserting that splat ran all ``layers`` attentions."""
    sf = splat.sparsify(fn, backend="jax", fallback=False)
    with warnings.catch_warnings(), splat.call_log() as log, splat.guard_log() as chose:
        warnings.simplefilter("error", splat.SparsifyWarning)
        out = jax.jit(sf)(*args)
        jax.effects_barrier()
    got = [(r.outcome, r.replaced, r.dense, r.decode) for r in log]
    assert got == [("splat", layers, 0, decode)], [(r.outcome, r.replaced, r.dense, r.reason) for r in log]
    assert all(chose), f"the original attention ran where a run-time check of positions failed: {chose}"
    return out


def check_forward(fn, params, *args, layers: int = LAYERS):
    close(run_splat(fn, params, *args, layers=layers, decode=False), jax.jit(fn)(params, *args))


def check_grad(fn, params, *args, layers: int = LAYERS):
    """Gradients of a cross-entropy-like loss of the logits ``fn(params, *args)``."""

    def loss(f):
        def value(p, *a):
            logits = f(p, *a)
            return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - logits[..., 0])

        return value

    sf = splat.sparsify(fn, backend="jax", fallback=False)
    with warnings.catch_warnings(), splat.call_log() as log:
        warnings.simplefilter("error", splat.SparsifyWarning)
        got = jax.jit(jax.grad(loss(sf)))(params, *args)
    assert [(r.outcome, r.replaced, r.dense) for r in log] == [("splat", layers, 0)], log
    close(got, jax.jit(jax.grad(loss(fn)))(params, *args))


def check_decode(step, state, chunks, layers: int = LAYERS):
    """``step(state, tokens) -> (logits, state)`` over ``chunks`` (a prefill, then single tokens):
    splat's decode path at every step, logits equal to the library's."""
    ref_state = state
    for toks in chunks:
        got, state = run_splat(step, state, toks, layers=layers, decode=True)
        want, ref_state = jax.jit(step)(ref_state, toks)
        close(got, want)
