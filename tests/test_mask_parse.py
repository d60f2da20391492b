"""splat.masks.parse: mask expressions parsed (never evaluated) into the same masks as the Python."""

from __future__ import annotations

import numpy as np
import pytest

from splat import masks


def _dense(mask, q_len, kv_len):
    """The mask from its own numpy predicate, independent of the layout code."""
    q, kv = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    return np.broadcast_to(mask(q, kv), (q_len, kv_len))


@pytest.mark.parametrize(
    "expr, want",
    [
        ("causal()", masks.causal()),
        (
            "sliding_window(256, 256) | global_tokens(4)",
            masks.sliding_window(256, 256) | masks.global_tokens(4),
        ),
        ("sliding_window(left=3, right=0)", masks.sliding_window(3, 0)),
        ("masks.strided(4) & causal()", masks.strided(4) & masks.causal()),
        (
            "  sink(2) | (dilated_window(8, 2) & block_local(16, lookback=2))  ",
            masks.sink(2) | (masks.dilated_window(8, 2) & masks.block_local(16, 2)),
        ),
        ("full()", masks.full()),
        ("block_local(16, 0)", masks.block_local(16, 0)),
    ],
)
def test_parse_gives_the_same_mask_as_the_python(expr, want):
    assert masks.parse(expr) == want


def test_parse_precedence_follows_python():
    # & binds tighter than |, as in Python; parentheses override
    a = masks.parse("sink(1) | causal() & strided(3)")
    b = masks.parse("(sink(1) | causal()) & strided(3)")
    s = 20
    sink, causal, strided = (_dense(m, s, s) for m in (masks.sink(1), masks.causal(), masks.strided(3)))
    np.testing.assert_array_equal(_dense(a, s, s), sink | (causal & strided))
    np.testing.assert_array_equal(_dense(b, s, s), (sink | causal) & strided)
    assert not np.array_equal(_dense(a, s, s), _dense(b, s, s))


def test_every_constructor_of_the_module_can_be_parsed():
    names = set(masks._constructors())
    assert {"full", "causal", "sliding_window", "dilated_window", "strided", "block_local"} <= names
    assert {"global_tokens", "sink"} <= names
    assert not names & {"Mask", "from_array", "from_fn", "parse"}


@pytest.mark.parametrize(
    "expr, match",
    [
        ("", "not a valid expression"),
        ("sliding_window(4", "not a valid expression"),
        ("__import__('os').system('true')", "only calls of mask constructors|unknown mask constructor"),
        ("os.system(1)", "only calls of mask constructors"),
        ("eval('1')", "unknown mask constructor 'eval'"),
        ("from_fn(1)", "unknown mask constructor 'from_fn'"),
        ("parse('causal()')", "unknown mask constructor 'parse'"),
        ("sliding_window(x)", "int or bool literal"),
        ("sliding_window(1.5)", "int or bool literal"),
        ("sliding_window('8')", "int or bool literal"),
        ("sliding_window(2 + 2)", "int or bool literal"),
        ("sliding_window(-x)", "int or bool literal"),
        ("sliding_window(*[1])", "int or bool literal"),
        ("sliding_window(**{'left': 1})", r"'\*\*' arguments"),
        ("causal() + causal()", "unsupported syntax"),
        ("~causal()", "unsupported syntax"),
        ("[causal()]", "unsupported syntax"),
        ("lambda: causal()", "unsupported syntax"),
        ("causal().__class__", "unsupported syntax"),
        ("sliding_window(1, 2, 3)", r"sliding_window\(1, 2, 3\): .*positional"),
        ("sliding_window()", "missing 1 required positional argument: 'left'"),
        # literals reach the constructor, which says what is wrong with them
        ("sliding_window(-3)", r"^sliding_window\(-3\): left must be >= 0, got -3$"),
        ("sliding_window(3, right=-1)", "right must be >= 0, got -1"),
        ("dilated_window(3, 0)", "dilation must be >= 1"),
        ("sliding_window(True)", "left must be an int, got bool True"),
        ("block_local(16, lookback=(1, 2))", "lookback must be an int, got tuple"),
        # a constructor named without its call
        ("causal", r"'causal' is a mask constructor, not a mask: call it, as in causal\(\)$"),
        ("sliding_window | causal()", r"as in sliding_window\(left, right=None\)"),
        ("masks.sink", r"as in sink\(n"),
    ],
)
def test_parse_errors_name_what_is_wrong(expr, match):
    with pytest.raises(ValueError, match=match):
        masks.parse(expr)


def test_parse_takes_only_strings():
    with pytest.raises(ValueError, match="must be a string, got int"):
        masks.parse(3)


def test_parse_never_evaluates(monkeypatch):
    import builtins

    def no_eval(*a, **k):
        raise AssertionError("parse must not evaluate")

    monkeypatch.setattr(builtins, "eval", no_eval)
    monkeypatch.setattr(builtins, "exec", no_eval)
    assert masks.parse("strided(3) | sink(1)") == masks.strided(3) | masks.sink(1)
