"""How ``splat bench`` times a call: samples of calls back to back, JAX calls chained in one executable.

:func:`time_call` takes the samples; :func:`sampling` is the policy (how many
calls a sample makes here); :func:`chain` and :func:`compile_timed` build the
one executable that makes a JAX peer's calls without host dispatch between
them. :data:`TIMING_METHOD` says all of it in words and lands in every JSON.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping

__all__ = ["TIMING_METHOD", "chain", "compile_timed", "on_gpu", "sampling", "time_call"]

TIMING_METHOD = (
    "ms per call = wall clock of one sample / the calls it made (the row's per_sample). A sample is "
    "launches back to back, then one wait for the device; on a GPU it makes at least 10 calls and, "
    "counted after the warmup, lasts at least min_sample_ms (settings), so its one-off costs (first "
    "dispatch, the wait) stay small. JAX peers: one launch runs 10 calls chained inside ONE jitted "
    "executable (Python-unrolled; each call's q is the previous call's out, in fwd+bwd its do the "
    "previous dq, and all inputs pass through lax.optimization_barrier with the previous outputs, so "
    "XLA neither merges, hoists nor drops calls), as attention inside a jitted training step: no host "
    "dispatch between calls. Torch peers: one launch is one call. Each row's 'timing' says which."
)


def on_gpu() -> bool:
    """Whether JAX runs on a GPU here (which sets the sampling policy and the default lengths)."""
    import jax

    return jax.default_backend() == "gpu"


def sampling() -> tuple[int, float]:
    """``(per_sample, min_sample_ms)`` for :func:`time_call` here: on a GPU at least 10
    calls (a JAX launch chains 10) and 20 ms per sample; on a CPU one call (TIMING_METHOD)."""
    return (10, 20.0) if on_gpu() else (1, 0.0)


def time_call(
    run: Callable[[], None] | None,
    warmup: int,
    repeats: int,
    *,
    launch: Callable[[], None] | None = None,
    sync: Callable[[], None] | None = None,
    per_sample: int = 1,
    calls_per_launch: int = 1,
    min_sample_ms: float = 0.0,
) -> dict:
    """Milliseconds per call: median, min and all samples, and how they were taken.

    Without ``launch``, each sample times one ``run()`` (which must block). With
    ``launch``/``sync``, a sample is launches back to back, each enqueuing
    ``calls_per_launch`` calls (a JAX peer's chain compiled into one executable),
    then one ``sync()``, divided by the calls made: ``per_sample / calls_per_launch``
    launches, or more where ``min_sample_ms`` asks (counted from one sample taken
    after the warmup), so that what a sample pays once (the first dispatch, the
    sync) is a small part of it. Warmup samples are taken the same way, untimed.

    Returns:
      ``{"ms", "ms_min", "samples_ms", "per_sample", "calls_per_launch", "timing"}``;
      ``per_sample`` is the calls a timed sample made, ``timing`` says how in words.
    """
    blocking = launch is None or sync is None
    if blocking:
        launch, sync, per_sample, calls_per_launch, min_sample_ms = run, (lambda: None), 1, 1, 0.0
    elif per_sample % calls_per_launch:
        raise ValueError(f"per_sample {per_sample} is not a multiple of calls_per_launch {calls_per_launch}")
    launches = per_sample // calls_per_launch

    def sample() -> float:
        t0 = time.perf_counter()
        for _ in range(launches):
            launch()
        sync()
        return (time.perf_counter() - t0) * 1e3 / (launches * calls_per_launch)

    for _ in range(warmup):
        sample()
    if min_sample_ms > 0:
        sample_ms = sample() * launches * calls_per_launch
        launches = max(launches, math.ceil(launches * min_sample_ms / max(sample_ms, 1e-6)))
    times = [sample() for _ in range(repeats)]
    if blocking:
        timing = "one blocking call"
    elif calls_per_launch > 1:
        timing = f"{launches} x {calls_per_launch} calls chained in one executable, one sync"
    else:
        timing = f"{launches} launch{'es' if launches > 1 else ''}, one sync"
    return {
        "ms": statistics.median(times),
        "ms_min": min(times),
        "samples_ms": times,
        "per_sample": launches * calls_per_launch,
        "calls_per_launch": calls_per_launch,
        "timing": timing,
    }


def chain(fn: Callable, n: int, feed: Mapping[int, int]) -> Callable:
    """``fn`` called ``n`` times back to back in one program, none merged, hoisted or dropped.

    For timing a call without per-call host dispatch: ``jax.jit(chain(fn, n, feed))``
    is one executable that makes ``n`` calls of ``fn``, each on inputs XLA must
    treat as new values that exist only once the previous call is done:

    * ``feed`` maps an argument index to the index of an output leaf
      (``jax.tree.leaves`` order) that replaces it in the next call: attention's
      ``out`` becomes the next ``q``, as in stacked layers. A true data
      dependency, which every backend keeps (XLA:CPU removes optimization
      barriers before its last CSE pass, and would merge calls on barriers alone).
    * All arguments and the previous outputs pass together through one
      ``jax.lax.optimization_barrier``, so work on the arguments that are not fed
      (``k``, ``v``) is redone per call, not hoisted or shared (XLA:GPU keeps
      barriers until after scheduling).
    * One element of each output leaf that is not fed is summed into a returned
      scalar: XLA prunes barrier outputs nobody reads, and with them the calls
      that made them. Those leaves stay alive to the end (memory, not time).

    The chain is unrolled in Python: a ``lax.fori_loop`` is an XLA while loop,
    whose condition XLA:GPU reads back on the host every iteration.

    Args:
      fn: ``fn(*args) -> pytree of arrays``.
      n: calls, at least 1.
      feed: ``{argument index: output leaf index}``; shapes and dtypes must match.

    Returns:
      ``chained(*args) -> (last call's output, float32 scalar)``.

    Example::

        chained = jax.jit(chain(lambda x: jnp.tanh(x @ x), 3, {0: 0}))
        out, _ = chained(jnp.eye(4))  # tanh applied 3 times, one dispatch
    """
    import jax
    import jax.numpy as jnp

    if n < 1:
        raise ValueError(f"chain needs n >= 1 calls, got {n}")
    fed = set(feed.values())

    def chained(*args):
        out = fn(*args)
        kept = []  # one element of each output leaf not fed forward
        for _ in range(n - 1):
            args, out = jax.lax.optimization_barrier((list(args), out))
            leaves = jax.tree.leaves(out)
            for a, o in feed.items():
                if (args[a].shape, args[a].dtype) != (leaves[o].shape, leaves[o].dtype):
                    raise ValueError(
                        f"feed {{{a}: {o}}}: output leaf {o} is {leaves[o].dtype}{list(leaves[o].shape)}, "
                        f"argument {a} is {args[a].dtype}{list(args[a].shape)}"
                    )
                args[a] = leaves[o]
            kept += [x.reshape(-1)[:1].astype(jnp.float32) for i, x in enumerate(leaves) if i not in fed]
            out = fn(*args)
        return out, jnp.concatenate(kept).sum() if kept else jnp.zeros((), jnp.float32)

    return chained


def compile_timed(
    fn: Callable, args: tuple, n: int, feed: Mapping[int, int]
) -> tuple[Callable, Callable[[], None], Callable[[], None]]:
    """``fn`` compiled for ``args``, and a launcher that times ``n`` calls in one executable.

    Returns ``(compiled, launch, sync)``: ``compiled(*args)`` makes one call (what
    the benchmark checks and reads memory figures from); ``launch()`` enqueues one
    run of ``chain(fn, n, feed)`` (:func:`chain`; ``compiled`` itself when ``n`` is
    1) and ``sync()`` waits for it. Each executable runs once here, so runtime
    failures (out of memory, ...) surface before any timing.
    """
    import jax

    compiled = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    timed = compiled if n == 1 else jax.jit(chain(fn, n, feed)).lower(*args).compile()
    pending = []

    def launch():
        pending[:] = [timed(*args)]

    def sync():
        jax.block_until_ready(pending)

    if n > 1:
        launch()
        sync()
    return compiled, launch, sync


def chained_ms(fn: Callable, *args, n: int = 10, warmup: int = 2, repeats: int = 5) -> float:
    """Median milliseconds per call of ``fn(*args)``: ``n`` calls chained in one executable
    (:func:`chain`, the first output fed back as the first argument), ``per_sample`` launches
    per sample, synced on the last launch's output (for spikes and scripts)."""
    _, launch, sync = compile_timed(fn, args, n, {0: 0})
    t = time_call(None, warmup, repeats, launch=launch, sync=sync, per_sample=n, calls_per_launch=n)
    return t["ms"]
