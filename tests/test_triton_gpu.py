"""The Triton backend through JAX (jax-triton) on a real GPU: ``pytest -m gpu``.

Skipped where JAX has no CUDA device or jax_triton is missing. Same dense
float64 reference as the interpreter tests.
"""

from __future__ import annotations

import numpy as np
import pytest

import acsr

jax = pytest.importorskip("jax")
if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA GPU (JAX default backend is not gpu)", allow_module_level=True)
jt = pytest.importorskip("jax_bindings._triton.backend")

import jax.numpy as jnp  # noqa: E402
from test_triton_kernels import _mask, _ref_bwd, _ref_fwd, _values_ref  # noqa: E402

pytestmark = pytest.mark.gpu

TOL = {"float32": 2e-4, "float16": 6e-3, "bfloat16": 3e-2}


def _arrays(rng, layout, B, H, Hkv, D, dtype):
    mk = lambda s: rng.standard_normal(s).astype(np.float32)
    q, do = mk((B, layout.q_len, H, D)), mk((B, layout.q_len, H, D))
    k, v = mk((B, layout.kv_len, Hkv, D)), mk((B, layout.kv_len, Hkv, D))
    cast = lambda x: jnp.asarray(x, dtype)
    host = lambda x: np.asarray(cast(x).astype(jnp.float32))
    return [cast(x) for x in (q, k, v, do)], [host(x) for x in (q, k, v, do)]


def _err(got, want):
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(got)), "non-finite output"
    return np.abs(got - want).max() / max(1.0, np.abs(want).max())


@pytest.mark.parametrize(
    "name,S,H,Hkv,D,dtype",
    [
        ("window", 300, 2, 2, 64, "bfloat16"),
        ("causal_window", 257, 4, 2, 128, "float16"),
        ("dilated", 300, 2, 1, 128, "bfloat16"),
        ("strided", 300, 2, 2, 64, "float32"),
        ("global_window", 300, 2, 2, 128, "bfloat16"),
        ("random", 200, 2, 2, 64, "float16"),
        ("masked_rows", 130, 2, 2, 256, "bfloat16"),
        ("window", 300, 2, 1, 256, "float16"),
    ],
)
def test_fused_gpu(name, S, H, Hkv, D, dtype):
    layout = acsr.from_dense(_mask(name, S, S))
    mask = layout.to_dense()
    (q, k, v, do), (hq, hk, hv, hdo) = _arrays(np.random.default_rng(S + D), layout, 2, H, Hkv, D, dtype)
    scale = D**-0.5
    out, lse = jax.jit(lambda a, b, c: jt.attention_fwd(a, b, c, None, layout, scale))(q, k, v)
    r_out, r_lse, _ = _ref_fwd(hq, hk, hv, mask, scale)
    assert _err(out, r_out) < TOL[dtype]
    lse = np.asarray(lse)
    assert np.all(np.isneginf(lse[:, :, ~mask.any(1)]))
    bwd = jax.jit(lambda q, k, v, o, lse, d: jt.attention_bwd(q, k, v, None, o, lse, d, layout, scale))
    grads = bwd(q, k, v, out, jnp.asarray(lse), do)
    for g, want in zip(grads, _ref_bwd(hq, hk, hv, mask, scale, hdo), strict=True):
        assert _err(g, want) < 4 * TOL[dtype]


@pytest.mark.parametrize("name", ["window", "strided", "random"])
def test_unfused_gpu(name):
    S, H, Hkv, D = 200, 2, 1, 64
    layout = acsr.from_dense(_mask(name, S, S))
    (q, k, v, do), (hq, hk, hv, hdo) = _arrays(np.random.default_rng(1), layout, 1, H, Hkv, D, "float32")
    want_s, cols = _values_ref(layout, hq, hk)
    s = jt.sddmm(q, k, layout)
    assert _err(s, want_s) < 2e-4
    p = jt.softmax(s, layout, 0.125)
    x = np.where(cols >= 0, np.asarray(s, np.float64) * 0.125, -np.inf)
    e = np.exp(x - np.max(x, -1, keepdims=True))
    assert _err(p, e / e.sum(-1, keepdims=True)) < 2e-4
    o = jt.spmm(p, v, layout)
    _, _, pref = _ref_fwd(hq, hk, hv, layout.to_dense(), 0.125)
    ref_o = np.einsum("bhqk,bkhd->bqhd", pref, np.repeat(hv, H // Hkv, axis=2).astype(np.float64))
    assert _err(o, ref_o) < 2e-4
    dp, dv = jt.spmm_bwd(p, v, do, layout)
    ds = jt.softmax_bwd(p, dp, layout, 0.125)
    dq, dk = jt.sddmm_bwd(q, k, ds, layout)
    r_dq, r_dk, r_dv = _ref_bwd(hq, hk, hv, layout.to_dense(), 0.125, hdo)
    assert _err(dv, r_dv) < 1e-3
    assert _err(dq, r_dq) < 1e-3
    assert _err(dk, r_dk) < 1e-3


def test_grad_vmap_through_dispatch():
    disp = pytest.importorskip("jax_bindings._dispatch")
    S, H, D = 160, 2, 64
    layout = acsr.from_dense(_mask("window", S, S))
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 1, S, H, D)), jnp.float32) for _ in range(3))

    def loss(q, k, v):
        return jnp.sum(disp.attention(q, k, v, layout, 0.125, backend="triton") ** 2)

    g = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v)
    g_ref = jax.jit(
        jax.vmap(
            jax.grad(
                lambda *a: jnp.sum(disp.attention(*a, layout, 0.125, backend="jax") ** 2), argnums=(0, 1, 2)
            )
        )
    )(q, k, v)
    for a, b in zip(g, g_ref, strict=True):
        assert _err(a, np.asarray(b, np.float64)) < 1e-3


def test_triton_cache_dir_survives_jax_triton_import():
    """jax_triton blanks TRITON_CACHE_DIR at import; the backend restores it for later Triton users."""
    import os

    assert os.environ.get("TRITON_CACHE_DIR") != ""
    import triton

    knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    if knobs is not None:
        assert knobs.cache.dir  # a folder Triton's cache manager can use


def test_kernels_carry_their_cubin_in_a_new_process(tmp_path):
    """jaxlib loads the cubin splat attached (module image): a second process with the
    same cache folder assembles nothing and gets the same output as the first."""
    import json
    import os
    import subprocess
    import sys

    script = (
        "import json, numpy as np, jax, jax.numpy as jnp, acsr\n"
        "from jax_bindings._triton import backend as jt\n"
        "from jax_bindings._triton import cache as _cache\n"
        "m = np.abs(np.arange(300)[:, None] - np.arange(300)[None, :]) <= 40\n"
        "layout = acsr.from_dense(m)\n"
        "q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 300, 2, 64)), jnp.bfloat16)\n"
        "out, _ = jax.jit(lambda a: jt.attention_fwd(a, a, a, None, layout, 0.125))(q)\n"
        "s = _cache.stats()\n"
        "print(json.dumps({'installed': jt.MODULE_IMAGES_INSTALLED, 'images': s['images'],"
        " 'hits': s['image_hits'], 'sum': float(jnp.sum(out.astype(jnp.float32)))}))\n"
    )
    env = dict(os.environ, SPLAT_CACHE_DIR=str(tmp_path))
    runs = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
            ).stdout.splitlines()[-1]
        )
        for _ in range(2)
    ]
    if not runs[0]["installed"]:
        pytest.skip("this jaxlib does not read TritonKernel.module_image")
    assert runs[0]["images"] == 1 and runs[0]["hits"] == 0
    assert runs[1]["images"] == 1 and runs[1]["hits"] == 1
    assert runs[0]["sum"] == runs[1]["sum"]
    assert len(list((tmp_path / "cubin").glob("*.cubin"))) == 1
