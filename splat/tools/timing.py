"""How ``splat bench`` times a call: samples of calls back to back, JAX calls chained in one executable.

:func:`time_call` takes one callable's samples, :func:`time_interleaved` several
callables' in alternating rounds (a :class:`Sampler` each); :func:`sampling` is
the policy (how many calls a sample makes here); :func:`chain` and
:func:`compile_timed` build the one executable that makes a JAX peer's calls
without host dispatch between them. :data:`TIMING_METHOD` says all of it in
words and lands in every JSON.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping

__all__ = ["INTERLEAVING", "TIMING_METHOD", "Sampler", "chain", "compile_timed", "on_gpu", "sampling",
           "time_call", "time_interleaved"]

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
# how time_interleaved takes several peers' samples, said where a tool times that way
INTERLEAVING = (
    "The peers of a (pattern, S, mode) are sampled in interleaved rounds: after each one's warmup, "
    "every round takes one sample of each peer, the first peer of a round rotating, so that a drift "
    "of the device's clock or temperature while the row is timed reaches all peers alike."
)


def on_gpu() -> bool:
    """Whether JAX runs on a GPU here (which sets the sampling policy and the default lengths)."""
    import jax

    return jax.default_backend() == "gpu"


def sampling() -> tuple[int, float]:
    """``(per_sample, min_sample_ms)`` for :func:`time_call` here: on a GPU at least 10
    calls (a JAX launch chains 10) and 20 ms per sample; on a CPU one call (TIMING_METHOD)."""
    return (10, 20.0) if on_gpu() else (1, 0.0)


class Sampler:
    """Samples of one callable, taken as :func:`time_call` describes: :meth:`warm` (the warmup
    samples, then the number of launches a sample makes), :meth:`sample` (one timed sample, ms a
    call), :meth:`result` (the samples as :func:`time_call` returns them)."""

    def __init__(
        self,
        run: Callable[[], None] | None,
        *,
        launch: Callable[[], None] | None = None,
        sync: Callable[[], None] | None = None,
        per_sample: int = 1,
        calls_per_launch: int = 1,
        min_sample_ms: float = 0.0,
    ):
        self.blocking = launch is None or sync is None
        if self.blocking:
            launch, sync, per_sample, calls_per_launch, min_sample_ms = run, (lambda: None), 1, 1, 0.0
        elif per_sample % calls_per_launch:
            raise ValueError(
                f"per_sample {per_sample} is not a multiple of calls_per_launch {calls_per_launch}")
        self.launch, self.sync = launch, sync
        self.calls_per_launch, self.min_sample_ms = calls_per_launch, min_sample_ms
        self.launches = per_sample // calls_per_launch

    def sample(self) -> float:
        """One sample: ``launches`` launches back to back, one sync; ms a call."""
        t0 = time.perf_counter()
        for _ in range(self.launches):
            self.launch()
        self.sync()
        return (time.perf_counter() - t0) * 1e3 / (self.launches * self.calls_per_launch)

    def warm(self, warmup: int) -> None:
        """``warmup`` untimed samples; then, with ``min_sample_ms``, more launches a sample where
        one sample (timed after the warmup) lasts less."""
        for _ in range(warmup):
            self.sample()
        if self.min_sample_ms > 0:
            sample_ms = self.sample() * self.launches * self.calls_per_launch
            wanted = math.ceil(self.launches * self.min_sample_ms / max(sample_ms, 1e-6))
            self.launches = max(self.launches, wanted)

    def alone(self, warmup: int, repeats: int) -> dict:
        """:meth:`warm`, then ``repeats`` samples back to back: their :meth:`result`."""
        self.warm(warmup)
        return self.result([self.sample() for _ in range(repeats)])

    def result(self, times: list[float]) -> dict:
        """``{"ms", "ms_min", "samples_ms", "per_sample", "calls_per_launch", "timing"}`` of ``times``."""
        if self.blocking:
            timing = "one blocking call"
        elif self.calls_per_launch > 1:
            timing = f"{self.launches} x {self.calls_per_launch} calls chained in one executable, one sync"
        else:
            timing = f"{self.launches} launch{'es' if self.launches > 1 else ''}, one sync"
        return {
            "ms": statistics.median(times),
            "ms_min": min(times),
            "samples_ms": times,
            "per_sample": self.launches * self.calls_per_launch,
            "calls_per_launch": self.calls_per_launch,
            "timing": timing,
        }


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
    sampler = Sampler(run, launch=launch, sync=sync, per_sample=per_sample, calls_per_launch=calls_per_launch,
                      min_sample_ms=min_sample_ms)
    return sampler.alone(warmup, repeats)


def time_interleaved(
    samplers: Mapping[str, Sampler], warmup: int, repeats: int
) -> tuple[dict[str, dict], dict[str, Exception]]:
    """The samplers' :meth:`Sampler.result`, their samples taken in ``repeats`` rounds of one
    sample each (after every one's warmup), round ``r`` starting at the ``r``-th sampler (in
    ``samplers``' order) and going round, so that no sampler always follows the same one.

    A sampler that raises is dropped from the rounds. Returns ``(results, errors)``, each keyed
    by the samplers' names; every name is in exactly one of them.
    """
    names, errors = list(samplers), {}

    def attempt(name: str, fn: Callable[[], object]):
        try:
            return fn()
        except Exception as e:  # a peer that fails mid-run must not end the others' timing
            errors[name] = e
            return None

    for name in names:
        attempt(name, lambda name=name: samplers[name].warm(warmup))
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            if name not in errors:
                ms = attempt(name, samplers[name].sample)
                if ms is not None:
                    times[name].append(ms)
    return {name: samplers[name].result(times[name]) for name in names if name not in errors}, errors


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


def chained_ms(fn: Callable, *args, feed: Mapping[int, int] | None = None, warmup: int = 2,
               repeats: int = 5) -> float:
    """Median milliseconds per call of ``fn(*args)`` under the :func:`sampling` policy: calls
    chained in one executable (:func:`chain`; ``feed`` says which output replaces which argument,
    by default the first output the first argument), a sample lasting at least the policy's
    ``min_sample_ms`` so that the launch and the sync stay a small part of short calls (for the
    tuner, spikes and scripts)."""
    n, min_ms = sampling()
    _, launch, sync = compile_timed(fn, args, n, {0: 0} if feed is None else feed)
    t = time_call(None, warmup, repeats, launch=launch, sync=sync, per_sample=n, calls_per_launch=n,
                  min_sample_ms=min_ms)
    return float(t["ms"])
