"""The splat CLI (analyze, bench errors, --version, python -m splat) and the README's code, run as written."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jax_bindings
from splat import masks
from splat.tools.cli import OUTPUT_FLAGS, build_parser, load_mask, main, version

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _dense(mask, q_len, kv_len):
    """The mask from its own numpy predicate, independent of the layout code."""
    q, kv = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    return np.broadcast_to(mask(q, kv), (q_len, kv_len))


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
    (tmp_path / "sub").mkdir()
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
    err = capsys.readouterr().err
    assert "needs matplotlib" in err
    # the distribution's name, which works for a wheel install too (not a clone's `-e .`)
    assert 'pip install "splat-attention[plot]"' in err and "pip install -e" not in err


def test_no_runtime_hint_says_pip_install_dash_e():
    """``pip install -e`` works in a clone only: what the installed packages tell a user must not say it."""
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for package in ("splat", "acsr", "jax_bindings")
        for path in sorted((ROOT / package).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "pip install -e" in line
    ]
    assert not found, found


# --- output paths: the folder must exist -----------------------------------------------------------

# A command line per command, and what it would start (replaced below by a trap: no work may begin).
_COMMANDS = {
    "analyze": (["analyze", "causal()", "--q-len", "16"], "splat.tools.cli.load_mask"),
    "bench": (["bench", "--patterns", "causal()", "--lengths", "16"], "splat.tools.bench.run_bench"),
    "bench-runtime": (["bench-runtime", "--quick"], "splat.tools.bench_runtime.run_runtime_bench"),
    "tune": (["tune", "--patterns", "causal", "--lengths", "64"], "splat.tools.tune.main"),
}


def _trap(*args, **kwargs):
    raise AssertionError("the command started its work before checking its output paths")


def test_every_output_flag_is_checked():
    """Every option that names a file to write (metavar JSON or PNG) is one the CLI checks."""
    commands = build_parser()._subparsers._group_actions[0].choices
    for command, sub in commands.items():
        files = {a.option_strings[0] for a in sub._actions if a.metavar in ("JSON", "PNG")}
        assert files == set(OUTPUT_FLAGS.get(command, ())), command
    assert set(OUTPUT_FLAGS) == set(_COMMANDS)


@pytest.mark.parametrize("command,flag", [(c, f) for c, flags in OUTPUT_FLAGS.items() for f in flags])
def test_output_in_a_missing_folder_is_refused_before_any_work(command, flag, tmp_path, monkeypatch, capsys):
    argv, work = _COMMANDS[command]
    monkeypatch.setattr(work, _trap)
    if command == "tune":  # where triton cannot run, tune would refuse for that reason first
        monkeypatch.setattr("jax_bindings._registry.unavailable", _trap)
    folder = tmp_path / "missing" / "dir"
    path = folder / "x.png"
    assert main([*argv, flag, str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"splat {command}: error: {flag} {path}: "), err
    assert f"folder {folder} does not exist" in err
    assert not (tmp_path / "missing").exists()  # nothing made


def test_output_path_that_is_a_folder_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("splat.tools.cli.load_mask", _trap)
    assert main(["analyze", "causal()", "--plot", str(tmp_path)]) == 2
    assert f"--plot {tmp_path} is a folder" in capsys.readouterr().err


# --- a closed standard output ----------------------------------------------------------------------

# Runs the CLI with a stdout that, once the CLI's first line is out, waits for the parent to close its
# end of the pipe (and say so on stdin): every later write meets the closed pipe, as under `| head -1`.
_FIRST_LINE_THEN_CLOSED = """
import sys
from splat.tools.cli import main

real = sys.stdout


class FirstLineGate:
    opened = False

    def write(self, text):
        n = real.write(text)
        if not self.opened and "\\n" in text:
            real.flush()
            self.opened = True
            sys.stdin.readline()
        return n

    def __getattr__(self, name):
        return getattr(real, name)


sys.stdout = FirstLineGate()
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_stdout_closed_after_the_first_line_exits_quietly(buffered):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    argv = ["analyze", "sliding_window(256, 256) | global_tokens(4)", "--q-len", "2048"]
    proc = subprocess.Popen(
        [sys.executable, "-c", _FIRST_LINE_THEN_CLOSED, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=env,
    )
    first = proc.stdout.readline()
    proc.stdout.close()  # the reader goes away after one line
    proc.stdin.write(b"\n")
    proc.stdin.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1, err  # Python's status for EPIPE (see splat.tools.cli.main)
    assert first.startswith(b"mask ")
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err


def test_python_dash_m_splat_into_a_pipe_closed_early():
    """``python -m splat analyze ... | head -1``: whenever the pipe closes, no traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "splat", "analyze", "neighborhood((32, 32), 7)"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    assert proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (0, 1), err  # 0: it had written everything before the close
    assert "Traceback" not in err and "BrokenPipe" not in err, err


# --- rough edges: clean errors, --version, python -m splat -----------------------------------------


def test_analyze_constructor_error_is_one_clean_line(capsys):
    assert main(["analyze", "sliding_window(-3)"]) == 2
    err = capsys.readouterr().err
    assert err == "splat analyze: error: sliding_window(-3): left must be >= 0, got -3\n"


def test_analyze_bare_constructor_name_suggests_the_call(capsys):
    assert main(["analyze", "causal"]) == 2
    err = capsys.readouterr().err
    assert "'causal' is a mask constructor" in err and "causal()" in err and "Traceback" not in err


def test_analyze_preview_says_when_it_shows_a_corner(capsys):
    assert main(["analyze", "global_tokens(4) | sliding_window(256, 256)", "--q-len", "2048"]) == 0
    assert "showing rows 0-15, cols 0-63 of 2048x2048" in capsys.readouterr().out
    assert main(["analyze", "causal()", "--q-len", "12"]) == 0
    assert "showing" not in capsys.readouterr().out  # the whole mask fits


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the message where there is no GPU")
def test_bench_on_a_backend_that_cannot_run_here_says_why_in_one_line(capsys):
    unusable = [b for b in jax_bindings.BACKENDS if b not in ("auto", "jax")]
    assert unusable, "no backend besides jax is registered"
    for backend in unusable:
        argv = ["--patterns", "causal()", "--lengths", "16", "--peers", "splat"]
        rc = main(["bench", "--backend", backend, *argv])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1, err
        assert err.startswith(f"splat bench: error: splat backend {backend!r} cannot run here: ")


def test_backend_choices_are_the_registered_backends():
    with pytest.raises(SystemExit):
        main(["bench", "--backend", "no-such-backend"])
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    (backend,) = [a for a in bench._actions if a.dest == "backend"]
    assert tuple(backend.choices) == tuple(jax_bindings.BACKENDS)


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"splat {version()}"
    assert re.fullmatch(r"\d+\.\d+\S*", version())


def test_version_falls_back_on_the_package_attribute(monkeypatch):
    import importlib.metadata

    import splat

    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: {})
    assert version() == splat.__version__


def test_python_dash_m_splat_runs_the_command():
    out = subprocess.run(
        [sys.executable, "-m", "splat", "--version"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"splat {version()}"


def test_import_splat_loads_no_tooling():
    """``import splat`` (fresh interpreter) loads none of splat.tools, matplotlib or torch."""
    code = (
        "import json, sys; import splat; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'torch') "
        "or m.startswith('splat.tools'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


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
