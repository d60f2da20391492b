"""How ``splat bench`` checks each peer's output against splat's on the same inputs.

Splat itself is tested against a float64 reference in ``tests/``; here every
peer's forward output is compared with splat's once per (pattern, S, dtype)
(:class:`OutputCheck`), by :func:`compare_outputs` under :data:`CHECK_RULE`. A
peer that disagrees is still timed, but flagged: a speed ratio against a peer
computing another mask means nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from splat.tools.peers import PEERS

__all__ = ["CHECK_RTOL", "CHECK_RULE", "OutputCheck", "compare_outputs", "short_error"]

# Output check tolerance, relative to max|splat out|, per input dtype. Two correct kernels differ
# by summation order and by where they round (scores, P before the PV matmul, the output): unit
# roundoff 2^-8 for bfloat16, 2^-11 for float16 and for float32 run as TF32 (the default of XLA
# and Triton float32 matmuls on NVIDIA GPUs), so one output ulp alone can be 2^-7 (bf16) or 2^-10
# of max|out|. Measured on CPU at D=128 (catalogue.BENCH, S=2048): splat_unfused and dense XLA
# are within 0.8% (bf16) and 0.15% (fp16) of splat. The tolerances sit 3-4x above that (~4 output
# ulps); a wrong mask moves outputs by a sizeable fraction of their magnitude.
CHECK_RTOL = {"float32": 5e-3, "float16": 5e-3, "bfloat16": 3e-2}
CHECK_RULE = (
    "agrees: max|peer out - splat out| <= rtol * max|splat out|, forward output on the same inputs, "
    "both cast to float32; rtol = " + ", ".join(f"{v:g} ({k})" for k, v in CHECK_RTOL.items())
)


def short_error(e: BaseException) -> str:
    """``"TypeName: first line of the message"`` (at most 200 characters of it)."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:200]}" if msg else type(e).__name__


def _unchecked(reason: str) -> dict:
    return {
        "max_abs_err_vs_splat": None,
        "rel_err_vs_splat": None,
        "check_tolerance": None,
        "agrees": None,
        "check": reason,
    }


def compare_outputs(got: np.ndarray, ref: np.ndarray, dtype: str) -> dict:
    """A peer's forward output against splat's (see :data:`CHECK_RULE`).

    Args:
      got, ref: ``[B, S, H, D]`` outputs, any float dtype (compared in float32).
      dtype: the inputs' dtype name, which sets the tolerance.

    Returns:
      ``{"max_abs_err_vs_splat", "rel_err_vs_splat", "check_tolerance", "agrees", "check"}``;
      a shape mismatch or a non-finite value in ``got`` does not agree.
    """
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    tol = CHECK_RTOL[dtype] * scale
    if got.shape != ref.shape:
        return {**_unchecked(f"output shape {got.shape} != splat's {ref.shape}"), "agrees": False}
    if not np.isfinite(got).all():
        return {**_unchecked("non-finite values in the output"), "agrees": False}
    err = float(np.max(np.abs(got - ref))) if ref.size else 0.0
    return {
        "max_abs_err_vs_splat": err,
        "rel_err_vs_splat": err / scale if scale > 0 else None,
        "check_tolerance": tol,
        "agrees": bool(err <= tol),
        "check": "forward output vs splat's",
    }


class OutputCheck:
    """Checks each peer's forward output against splat's for one (pattern, S, dtype).

    Each peer is checked once (its first mode; fwd+bwd reuses the forward check)
    at the cost of one extra run of what it already compiled. The reference is
    splat's own row when splat ran; when splat is not among the peers, splat's
    forward is computed once for the check alone.
    """

    def __init__(self, where: dict, make_problem: Callable, disagreements: list, log: Callable):
        self.where, self.make_problem = where, make_problem
        self.disagreements, self.log = disagreements, log
        self.ref: np.ndarray | None = None
        self.ref_missing = ""  # why there is no reference, once known
        self.done: dict[str, dict] = {}

    def no_reference(self, reason: str) -> None:
        if self.ref is None and not self.ref_missing:
            self.ref_missing = reason

    def _reference(self) -> np.ndarray | None:
        if self.ref is None and not self.ref_missing:
            try:  # splat was not asked for: compute its forward for the check alone (untimed: no chain)
                prepared = PEERS["splat"].prepare(self.make_problem("fwd", per_sample=1))
                self._set_reference(_forward_output(prepared, "fwd"))
            except Exception as e:
                self.no_reference(f"splat failed: {short_error(e)}")
        return self.ref

    def _set_reference(self, out: np.ndarray) -> None:
        if np.isfinite(out).all():
            self.ref = out
        else:
            self.no_reference("splat's output has non-finite values")

    def verdict(self, peer: str, prepared, problem) -> dict:
        """The check fields of ``peer``'s rows (computed on its first call, then reused)."""
        if peer in self.done:
            return self.done[peer]
        if PEERS[peer].no_check:
            v = _unchecked(PEERS[peer].no_check)
        else:
            try:
                out = _forward_output(prepared, problem.mode)
            except Exception as e:  # the check must not cost the timing
                v = _unchecked(f"could not read the output: {short_error(e)}")
                self.log(f"  warning: {peer} output not checked ({v['check']})")
            else:
                if peer == "splat":
                    self._set_reference(out)
                ref = self._reference()
                if ref is None and peer == "splat":  # splat vs nothing: its output is broken
                    v = {**_unchecked(self.ref_missing), "agrees": False}
                elif ref is None:
                    v = _unchecked(f"no splat output to compare with ({self.ref_missing})")
                else:
                    v = compare_outputs(out, ref, problem.dtype)
                del out
        if v["agrees"] is False:
            self.disagreements.append({**self.where, "impl": peer, **v})
            w = self.where
            err = v["max_abs_err_vs_splat"]
            self.log(
                f"  !!! WARNING: {peer} DISAGREES WITH SPLAT on {w['pattern']} S={w['S']} {w['dtype']}: "
                + (
                    f"max|{peer} - splat| = {err:.4g} > tolerance {v['check_tolerance']:.4g}"
                    if err is not None
                    else v["check"]
                )
                + "; its timings are not comparable"
            )
        self.done[peer] = v
        return v


def _forward_output(prepared, mode: str) -> np.ndarray:
    """The attention output of one run of ``prepared``, float32 numpy ``[B, S, H, D]``."""
    if prepared.outputs is None:
        raise ValueError("this peer's Prepared has no outputs()")
    got = prepared.outputs()
    if mode == "fwdbwd":
        got = got[0]
    return np.asarray(got, np.float32)
