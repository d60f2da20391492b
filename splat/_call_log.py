"""Did splat run? One :class:`CallRecord` per front-end call, for frameworks that hide the answer.

Keras (and any code with a broad ``try/except``) catches an exception from an attention
function and quietly runs its own dense attention, so neither a warning nor an error reaches the
user. The front ends (``@splat.sparse_attention``, ``splat.sparsify``, ``splat.flax.attention_fn``)
therefore write down each call's outcome *before* returning or raising:

- :func:`call_log` collects the records of the calls made in this thread while it is open;
- :func:`call_counts` counts outcomes over the whole process.

Records are made when the front end runs in Python: under ``jit`` that is at trace time, once
per trace (a compiled function called again makes no new record). They count traces, not
executions.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

__all__ = ["CallRecord", "call_counts", "call_log", "error_message", "guard_log", "guard_sinks", "record"]

Outcome = Literal["splat", "fallback", "error"]


@dataclass(frozen=True)
class CallRecord:
    """One front-end call (one trace under ``jit``) and what ran.

    Attributes:
      front_end: ``"sparse_attention(<fn name>)"``, ``"sparsify(<fn name>)"`` or
        ``"flax.attention_fn"``.
      outcome: ``"splat"`` (splat's attention ran), ``"fallback"`` (the dense original
        ran; ``reason`` says why) or ``"error"`` (the call raised; ``reason`` holds the
        exception as ``"<type>: <message>"``).
      reason: see ``outcome``; for ``"splat"`` from ``sparsify``, the attentions that stayed
        dense, if any; else None.
      q_shape, kv_shape: the query and key shapes (``[batch..., S, H, D]``) as called; for
        ``sparsify``, those of the first attention replaced, as its ``q k^T`` operands appear
        inside the function (``jax.nn.dot_product_attention`` reshapes q to
        ``[B, S, Hk, group, D]``; per example under ``vmap``). None where unknown (a
        ``sparsify`` fallback, or a call that raised before they were read).
      mask: ``repr`` of the mask splat used (for ``sparsify``, of each distinct mask found,
        joined by ``"; "``), or None.
      decode: whether the call was a decode step (one query against a KV cache); for
        ``sparsify``, whether every attention it replaced takes its queries at positions known
        only at run time (a KV cache's, splat's decode path); None where unknown.
      replaced, dense: for ``sparsify``, how many attentions splat ran in this call and how many
        it found but left dense (``reason`` says why); None for the other front ends.
      backend: the backend asked for when it is a single one (it ran, or the call
        raised); None under ``backend="auto"``, where the choice is made further down.
    """

    front_end: str
    outcome: Outcome
    reason: str | None = None
    q_shape: tuple[int, ...] | None = None
    kv_shape: tuple[int, ...] | None = None
    mask: str | None = None
    decode: bool | None = None
    backend: str | None = None
    replaced: int | None = None
    dense: int | None = None


_local = threading.local()  # .logs, .guard_logs: the open call_log / guard_log lists of this thread
_counts: Counter[str] = Counter()
_counts_lock = threading.Lock()


@contextlib.contextmanager
def _opened(kind: str) -> Iterator[list]:
    """A new list open in this thread's ``_local.<kind>`` (the open logs of one kind, outermost
    first) while the block runs."""
    logs = getattr(_local, kind, None)
    if logs is None:
        logs = []
        setattr(_local, kind, logs)
    out: list = []
    logs.append(out)
    try:
        yield out
    finally:
        del logs[next(i for i, x in enumerate(logs) if x is out)]  # by identity: equal lists abound


@contextlib.contextmanager
def call_log() -> Iterator[list[CallRecord]]:
    """Collect a :class:`CallRecord` for every splat front-end call made in this thread meanwhile.

    Logs nest: a call made inside two open logs is recorded in both. Calls made by other
    threads are not recorded here. Under ``jit`` a call is recorded when it is traced, once per
    trace: records count traces, not executions of the compiled function.

    Yields:
      The list the records are appended to (it stays readable after the block).

    Example:
      >>> import jax, splat
      >>> attn = splat.sparse_attention(lambda q, k, v: None, mask=splat.masks.causal())
      >>> q = jax.numpy.ones((1, 8, 1, 4))
      >>> with splat.call_log() as log:
      ...     _ = attn(q, q, q)
      >>> [(r.front_end, r.outcome) for r in log]
      [('sparse_attention(<lambda>)', 'splat')]
    """
    with _opened("logs") as out:
        yield out


@contextlib.contextmanager
def guard_log() -> Iterator[list[bool]]:
    """Collect, at run time, which attention each of ``splat.sparsify``'s run-time checks chose.

    Some attentions ``sparsify`` replaces take positions computed from the inputs, which splat
    checks when the compiled function runs (positions inside the mask, equal to the indices where
    the mask also reads those): where a check fails, the original dense attention runs, exactly,
    so a :class:`CallRecord` (made at trace time) cannot say which one ran. A guarded attention
    traced while this log is open reports every execution's choice to it: True, splat's
    attention; False, the original. Each report is a host callback, so leave it closed where
    speed matters; records arrive asynchronously (``jax.effects_barrier()`` waits for them).

    Yields:
      The list the choices are appended to, in execution order.

    Example:
      >>> import jax, jax.numpy as jnp, splat
      >>> def attn(q, k, v, pos):  # a window on positions given as an input
      ...     s = jnp.einsum("qd,kd->qk", q, k)
      ...     near = (pos[None, :] > pos[:, None] - 3) & (pos[None, :] < pos[:, None] + 3)
      ...     return jax.nn.softmax(jnp.where(near, s, -1e30)) @ v
      >>> x = jnp.ones((8, 4))
      >>> with splat.guard_log() as chose:
      ...     _ = jax.jit(splat.sparsify(attn))(x, x, x, jnp.arange(8))
      ...     jax.effects_barrier()
      >>> chose
      [True]
    """
    with _opened("guard_logs") as out:
        yield out


def guard_sinks() -> tuple[list[bool], ...]:
    """The :func:`guard_log` lists open in this thread now (where a guarded attention being
    traced reports its run-time choices)."""
    return tuple(getattr(_local, "guard_logs", ()))


def call_counts(reset: bool = False) -> dict[str, int]:
    """How many front-end calls (traces, under ``jit``) ended in each outcome, process-wide.

    Args:
      reset: set every count back to zero after reading them.

    Returns:
      ``{"splat": n, "fallback": n, "error": n}`` (outcomes never seen are left out),
      counted since the process started or the last ``call_counts(reset=True)``.

    Example:
      >>> import splat
      >>> _ = splat.call_counts(reset=True)
      >>> splat.call_counts()
      {}
    """
    with _counts_lock:
        out = dict(_counts)
        if reset:
            _counts.clear()
    return out


def _shape(x) -> tuple[int, ...] | None:
    s = getattr(x, "shape", None)
    return None if s is None else tuple(int(n) for n in s)


def record(
    front_end: str,
    outcome: Outcome,
    *,
    reason: str | None = None,
    q=None,
    k=None,
    mask=None,
    decode: bool | None = None,
    backend: str | None = None,
    replaced: int | None = None,
    dense: int | None = None,
) -> CallRecord:
    """Write one call's record to every open :func:`call_log` of this thread and to the counts.

    ``q``/``k``: arrays (or shapes as tuples); ``mask``: any object, kept as its ``repr``;
    ``backend``: as asked (``"auto"`` is recorded as None).
    """
    rec = CallRecord(
        front_end=front_end,
        outcome=outcome,
        reason=reason,
        q_shape=q if isinstance(q, tuple) else _shape(q),
        kv_shape=k if isinstance(k, tuple) else _shape(k),
        mask=None if mask is None else mask if isinstance(mask, str) else repr(mask),
        decode=decode,
        backend=None if backend in (None, "auto") else backend,
        replaced=replaced,
        dense=dense,
    )
    with _counts_lock:
        _counts[outcome] += 1
    for log in getattr(_local, "logs", ()):
        log.append(rec)
    return rec


def error_message(e: BaseException) -> str:
    """An exception as a record's ``reason``: ``"<type>: <message>"``."""
    return f"{type(e).__name__}: {e}"
