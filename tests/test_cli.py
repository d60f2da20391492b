"""The splat CLI (spec parser, analyze, plots) and the README's code, which must run as written."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

import acsr
import splat
from splat import catalogue, masks
from splat.cli import SpecError, load_mask, main, parse_mask_spec

README = Path(__file__).resolve().parent.parent / "README.md"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _dense(mask, q_len, kv_len):
    """The mask from its own numpy predicate, independent of the layout code."""
    q, kv = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    return np.broadcast_to(mask(q, kv), (q_len, kv_len))


# --- the spec parser ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, want",
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
    ],
)
def test_spec_parses_to_the_same_mask(spec, want):
    assert parse_mask_spec(spec) == want


def test_spec_precedence_follows_python():
    # & binds tighter than |, as in Python; parentheses override
    a = parse_mask_spec("sink(1) | causal() & strided(3)")
    b = parse_mask_spec("(sink(1) | causal()) & strided(3)")
    s = 20
    np.testing.assert_array_equal(
        _dense(a, s, s),
        _dense(masks.sink(1), s, s) | (_dense(masks.causal(), s, s) & _dense(masks.strided(3), s, s)),
    )
    np.testing.assert_array_equal(
        _dense(b, s, s),
        (_dense(masks.sink(1), s, s) | _dense(masks.causal(), s, s)) & _dense(masks.strided(3), s, s),
    )
    assert not np.array_equal(_dense(a, s, s), _dense(b, s, s))


@pytest.mark.parametrize(
    "spec, match",
    [
        ("", "not a valid expression"),
        ("sliding_window(4", "not a valid expression"),
        ("__import__('os').system('true')", "only calls of mask constructors|unknown mask constructor"),
        ("os.system(1)", "only calls of mask constructors"),
        ("eval('1')", "unknown mask constructor 'eval'"),
        ("from_fn(1)", "unknown mask constructor 'from_fn'"),
        ("sliding_window(x)", "int literal"),
        ("sliding_window(1.5)", "int literal"),
        ("sliding_window(True)", "int literal"),
        ("sliding_window('8')", "int literal"),
        ("sliding_window(-1)", "int literal"),
        ("sliding_window(2 + 2)", "int literal"),
        ("sliding_window(*[1])", "int literal"),
        ("sliding_window(**{'left': 1})", r"'\*\*' arguments"),
        ("causal() + causal()", "unsupported syntax"),
        ("~causal()", "unsupported syntax"),
        ("causal", "unsupported syntax"),
        ("[causal()]", "unsupported syntax"),
        ("lambda: causal()", "unsupported syntax"),
        ("causal().__class__", "unsupported syntax"),
        ("sliding_window(1, 2, 3)", "sliding_window"),
        ("dilated_window(3, 0)", "dilation"),
    ],
)
def test_spec_errors_are_clear(spec, match):
    with pytest.raises(SpecError, match=match):
        parse_mask_spec(spec)


def test_spec_error_is_a_value_error():
    assert issubclass(SpecError, ValueError)
    with pytest.raises(SpecError, match="must be a string"):
        parse_mask_spec(3)


# --- splat analyze -------------------------------------------------------------------------------


def test_analyze_spec_prints_report_and_layout(capsys):
    spec = "sliding_window(5, 2) | global_tokens(3)"
    assert main(["analyze", spec, "--q-len", "96", "--kv-len", "80"]) == 0
    out = capsys.readouterr().out
    want = _dense(masks.sliding_window(5, 2) | masks.global_tokens(3), 96, 80)
    assert f"nonzeros    {int(want.sum())} " in out
    assert "96 x 80" in out and "segment 0" in out
    assert f"ACSR(96x80, nnz={int(want.sum())}" in out
    # the character picture's first row is the mask's first row
    pic = [line.strip() for line in out.splitlines() if set(line.strip()) <= {"#", "."} and line.strip()]
    assert pic[0] == "".join("#" if x else "." for x in want[0, :64])


def test_analyze_default_length(capsys):
    assert main(["analyze", "causal()"]) == 0
    assert "1024 x 1024" in capsys.readouterr().out


def test_analyze_npy(tmp_path, capsys):
    rng = np.random.default_rng(11)
    arr = rng.random((70, 90)) < 0.15
    arr[:, :3] = True
    path = tmp_path / "m.npy"
    np.save(path, arr)
    assert main(["analyze", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"nonzeros    {int(arr.sum())} " in out and "70 x 90" in out
    obj, q_len, kv_len = load_mask(str(path), None, None)
    np.testing.assert_array_equal(obj, arr)
    assert (q_len, kv_len) == (70, 90)


@pytest.mark.parametrize(
    "setup, argv_tail, match",
    [
        (lambda p: np.save(p, np.ones((4, 4), np.float32)), [], "2-D boolean"),
        (lambda p: np.save(p, np.ones((2, 4, 4), bool)), [], "2-D boolean"),
        (lambda p: np.save(p, np.ones((4, 5), bool)), ["--q-len", "8"], "does not match"),
        (lambda p: p.write_bytes(b"not numpy"), [], "cannot read"),
        (lambda p: None, [], "does not exist"),
    ],
)
def test_analyze_npy_errors(tmp_path, capsys, setup, argv_tail, match):
    path = tmp_path / "bad.npy"
    setup(path)
    assert main(["analyze", str(path), *argv_tail]) == 2
    assert re.search(match, capsys.readouterr().err)


def test_analyze_bad_spec_exits_2(capsys):
    assert main(["analyze", "sliding_window(4) + 1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("splat analyze: error:") and "unsupported syntax" in err


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["analyze"],
        ["analyze", "causal()", "--q-len", "0"],
        ["analyze", "causal()", "--q-len", "ten"],
        ["bench", "--mode", "sideways"],
        ["bench", "--heads", "-2"],
        ["bench", "--dtype", "int8"],
        ["bench", "--lengths"],
    ],
)
def test_argument_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_analyze_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "sub" / "mask.png"
    assert main(["analyze", "dilated_window(12, 3) | sink(2)", "--q-len", "200", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert f"wrote {path}" in capsys.readouterr().out


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, tmp_path, capsys):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *a, **kw):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    assert main(["analyze", "causal()", "--q-len", "32", "--plot", str(tmp_path / "x.png")]) == 2
    assert "needs matplotlib" in capsys.readouterr().err


# --- the segment picture ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["global_window", "sink_causal_window", "dilated_window", "strided_local"])
def test_segment_image_labels_each_segment(name):
    from splat._plot import segment_image

    layout = catalogue.SMALL[name].to_acsr(150, 170)
    img = segment_image(layout, max_pixels=1024)
    np.testing.assert_array_equal(img > 0, layout.to_dense())
    for k, seg in enumerate(layout.segments):
        alone = acsr.ACSR(layout.q_len, layout.kv_len, (seg,)).to_dense()
        np.testing.assert_array_equal(img == k + 1, alone)


def test_segment_image_residual_and_sampling():
    from splat._plot import segment_image

    m = catalogue.random_mask(128, 128, density=0.2, seed=5)
    layout = splat.analyze(m)
    assert layout.residual is not None
    img = segment_image(layout)
    np.testing.assert_array_equal(img == len(layout.segments) + 1, layout.residual.dense(128, 128))
    # sampled: every 2nd row, columns binned by 2 -> a bin is lit where any of its columns is
    big = masks.sliding_window(3).to_acsr(300, 300)
    small = segment_image(big, max_pixels=150)
    dense = big.to_dense()[::2]
    np.testing.assert_array_equal(small > 0, dense[:, 0::2] | dense[:, 1::2])


# --- the README ------------------------------------------------------------------------------------------

_FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", re.M | re.S)


def _readme_blocks(lang: str) -> list[str]:
    blocks = []
    for m in _FENCE.finditer(README.read_text()):
        if m.group(1) == lang and 'title="no-run"' not in m.group(2):
            blocks.append(m.group(3))
    return blocks


def test_readme_has_runnable_blocks():
    assert len(_readme_blocks("python")) >= 5
    assert any(line.startswith("splat ") for b in _readme_blocks("bash") for line in b.splitlines())
    assert "<!-- models-section -->" in README.read_text() or "sparse_attention" in README.read_text()


def test_readme_python_blocks_run(tmp_path, monkeypatch, capsys):
    """Every python block, in order, in one namespace (as a reader would paste them)."""
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": "__readme__"}
    for i, block in enumerate(_readme_blocks("python")):
        try:
            exec(compile(block, f"README.md python block {i + 1}", "exec"), ns)
        except Exception as e:
            first = block.strip().splitlines()[0]
            raise AssertionError(f"README python block {i + 1} (starting {first!r}) failed: {e!r}") from e


def test_readme_cli_lines_run(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    lines = [ln for b in _readme_blocks("bash") for ln in b.splitlines() if ln.startswith("splat ")]
    for line in lines:
        argv = shlex.split(line)[1:]
        assert main(argv) == 0, line
        for flag in ("--out", "--plot"):
            if flag in argv:
                assert os.path.getsize(argv[argv.index(flag) + 1]) > 0, line
