"""A process's first Triton lowering does not import torch (``jax_bindings._triton.first_call``).

Each check runs in a fresh interpreter (Triton's specialization initialises once a process),
with a stand-in ``torch`` package first on ``sys.path``. On a GPU, torch's own Triton kernels
(FlexAttention) still run after splat's first lowering.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _specialize_in_fresh_process(tmp_path: Path, hide: bool) -> list[str]:
    """Triton's specialization of an int, whether torch was imported by then, and the stand-in
    torch's ``Tensor`` imported afterwards, in a fresh interpreter."""
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("class Tensor:\n    pass\n")
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(site)!r})
        from jax_bindings._triton import first_call
        if {hide}:
            first_call.specialize_without_torch()
        import triton._C.libtriton as libtriton
        print(libtriton.native_specialize_impl(None, 1, False, False, False))
        print("torch" in sys.modules)
        import torch
        print(torch.Tensor.__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()


def test_the_first_specialization_leaves_torch_alone(tmp_path):
    libtriton = pytest.importorskip("triton._C.libtriton")
    if not hasattr(libtriton, "native_specialize_impl"):
        pytest.skip("this Triton has no native specialization")
    # Triton 3.6 (the GPU machine's) imports torch here; later versions may not
    plain = _specialize_in_fresh_process(tmp_path / "plain", hide=False)
    hidden = _specialize_in_fresh_process(tmp_path / "hidden", hide=True)
    assert plain[1] in ("True", "False") and plain[2] == "Tensor"
    assert hidden == [plain[0], "False", "Tensor"]  # the same specialization; torch imports later as before


@pytest.mark.gpu
def test_torch_triton_kernels_run_after_splats_first_lowering():
    pytest.importorskip("torch")
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        import splat
        from splat import masks
        q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 512, 2, 64)), jnp.bfloat16)
        out = splat.attention(q, q, q, mask=masks.sliding_window(64, 64), backend="triton")
        jax.block_until_ready(out)
        import sys
        assert "torch" not in sys.modules, "splat's lowering imported torch"
        import torch
        from torch.nn.attention.flex_attention import flex_attention
        t = torch.randn(1, 2, 512, 64, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.scaled_dot_product_attention(t, t, t)
        got = torch.compile(flex_attention)(t, t, t)
        print(float((got - ref).abs().max()))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.split()[-1]) < 0.05
