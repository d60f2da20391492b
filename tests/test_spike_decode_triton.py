"""The split-KV decode spike (``benchmarks/spikes/spike_decode_triton.py``) under Triton's interpreter.

Its split and combine kernels run on numpy arrays (float16 / float32: the interpreter mishandles
bfloat16 dots) against a float64 numpy reference of the same masked attention. Cache rows past
``cache_seqlens`` hold NaN, so a masked key that leaked into a sum would show. bfloat16, the
speed and jax-triton's launch path run on a GPU only, in the module's ``main()``.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

# a spike's kernels, not the product's (tests/test_triton_decode.py covers those): --runslow
pytestmark = pytest.mark.slow

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "spikes" / "spike_decode_triton.py"


def _load():
    spec = importlib.util.spec_from_file_location("spike_decode_triton", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up by name
    spec.loader.exec_module(mod)
    return mod


dec = _load()

# |out - ref| <= ATOL + RTOL * |ref|: float16 rounds p before the PV dot and the output; float32 is exact-ish
TOL = {np.float16: (2e-3, 2e-3), np.float32: (1e-5, 1e-5)}
L_CACHE, H = 200, 4  # 200: not a multiple of block_n


def reference(q, k, v, lens, window=None, scale=None):
    """Dense masked attention in float64: query i of row b at ``lens[b] - Sq + i`` sees keys
    ``max(0, pos - window) <= j <= pos``; a query that sees none outputs 0."""
    B, Sq, Hq, D = q.shape
    L, Hk = k.shape[1], k.shape[2]
    G = Hq // Hk
    scale = D**-0.5 if scale is None else scale
    out = np.zeros(q.shape, np.float64)
    j = np.arange(L)
    for b in range(B):
        for i in range(Sq):
            pos = int(lens[b]) - Sq + i
            ok = (j <= pos) & (j < lens[b])
            if window is not None:
                ok &= j >= pos - window
            if not ok.any():
                continue
            kk = k[b, ok].astype(np.float64)  # [n, Hk, D]
            vv = v[b, ok].astype(np.float64)
            for h in range(Hq):
                s = kk[:, h // G] @ q[b, i, h].astype(np.float64) * scale
                p = np.exp(s - s.max())
                out[b, i, h] = p @ vv[:, h // G] / p.sum()
    return out


def _inputs(rng, dtype, *, Hk, D, Sq, lens, L=L_CACHE):
    B = len(lens)
    q = rng.standard_normal((B, Sq, H, D)).astype(dtype)
    k = rng.standard_normal((B, L, Hk, D)).astype(dtype)
    v = rng.standard_normal((B, L, Hk, D)).astype(dtype)
    for b, n in enumerate(lens):  # past the row's length: garbage that must not contribute
        k[b, n:] = np.nan
        v[b, n:] = np.nan
    return q, k, v, np.asarray(lens, np.int32)


def _check(out, ref, dtype):
    atol, rtol = TOL[dtype]
    assert out.dtype == dtype and out.shape == ref.shape
    assert np.isfinite(out).all()
    err = np.abs(out.astype(np.float64) - ref)
    bound = atol + rtol * np.abs(ref)
    assert (err <= bound).all(), f"max error {err.max():.3g}, worst excess {(err - bound).max():.3g}"


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("Hk,D", [(2, 32), (1, 32), (2, 64), (1, 64)])
@pytest.mark.parametrize("Sq", [1, 3])
@pytest.mark.parametrize("window", [None, 37])
def test_matches_reference(rng, dtype, Hk, D, Sq, window):
    # row 1 is tiny: with Sq=3, its first query sits at position -1 and sees no key (output 0)
    q, k, v, lens = _inputs(rng, dtype, Hk=Hk, D=D, Sq=Sq, lens=[L_CACHE, 2])
    ref = reference(q, k, v, lens, window)
    # 200 keys = 4 tiles of 64 (3 + a partial one; with w=37 one or two): 8 splits leave some empty
    for num_splits in (None, 1, 3, 8):
        out = dec.decode_numpy(q, k, v, lens, window=window, num_splits=num_splits, block_n=64)
        _check(out, ref, dtype)
    _check(dec.decode_numpy(q, k, v, lens, window=window), ref, dtype)  # default tile and splits
    if Sq == 3:
        assert not ref[1, 0].any() and not out[1, 0].any()


@pytest.mark.parametrize("block_n", [16, 32, 128])
def test_block_n(rng, block_n):
    q, k, v, lens = _inputs(rng, np.float16, Hk=2, D=32, Sq=3, lens=[L_CACHE - 9, 70])
    for window in (None, 37):
        ref = reference(q, k, v, lens, window)
        for num_splits in (1, 5):
            _check(dec.decode_numpy(q, k, v, lens, window=window, num_splits=num_splits, block_n=block_n),
                   ref, np.float16)


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["f16", "f32"])
def test_tensor_descriptors(rng, dtype):
    """tma=True: K/V tiles through tl.make_tensor_descriptor, bounded at the row's length."""
    q, k, v, lens = _inputs(rng, dtype, Hk=2, D=64, Sq=3, lens=[L_CACHE - 5, 2])
    for window in (None, 37):
        ref = reference(q, k, v, lens, window)
        for num_splits in (1, 3, 8):
            out = dec.decode_numpy(q, k, v, lens, window=window, num_splits=num_splits, tma=True)
            _check(out, ref, dtype)


def test_combine_in_jnp(rng):
    """The splits combined by jnp ops agree with the combine kernel (and the reference)."""
    q, k, v, lens = _inputs(rng, np.float32, Hk=1, D=32, Sq=3, lens=[L_CACHE, 2])
    ref = reference(q, k, v, lens, 37)
    a = dec.decode_numpy(q, k, v, lens, window=37, num_splits=3, combine="triton")
    b = dec.decode_numpy(q, k, v, lens, window=37, num_splits=3, combine="jnp")
    _check(a, ref, np.float32)
    _check(b, ref, np.float32)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_empty_rows_output_zero(rng):
    """cache_seqlens 0: no key at all; 1 with Sq=3: only the last query sees key 0."""
    q, k, v, lens = _inputs(rng, np.float16, Hk=2, D=32, Sq=3, lens=[0, 1])
    for num_splits in (1, 4):
        out = dec.decode_numpy(q, k, v, lens, num_splits=num_splits)
        assert not out[0].any() and not out[1, :2].any()
        # one key: its value row, for each head of its group (heads 0, 1 -> KV head 0; 2, 3 -> 1)
        np.testing.assert_array_equal(out[1, 2], np.repeat(v[1, 0], 2, axis=0))


def test_reruns_bit_identical(rng):
    q, k, v, lens = _inputs(rng, np.float16, Hk=2, D=64, Sq=3, lens=[L_CACHE, 150])
    for num_splits in (1, 3):
        a = dec.decode_numpy(q, k, v, lens, window=37, num_splits=num_splits)
        b = dec.decode_numpy(q, k, v, lens, window=37, num_splits=num_splits)
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.parametrize("B,L,window,programs", [(8, 32768, None, 64), (1, 131072, None, 8),
                                                (64, 8192, None, 512), (8, 32768, 4096, 64)])
def test_split_heuristic_fills_the_gpu(B, L, window, programs):
    """The four target shapes (H=32, Hk=8, D=128, bf16) on 132 SMs: the grid fills at least 90% of
    its last wave of resident programs, and each split keeps >= 4 tiles."""
    for block_n in (None, 64):
        p = dec.plan((B, 1, 32, 128), (B, L, 8, 128), "bfloat16", window=window, block_n=block_n,
                     sm_count=132)
        assert p.grid == (p.num_splits, programs)
        slots = 132 * dec.programs_per_sm(p.block_n, 128, 2, 3, 4)
        total = p.num_splits * programs
        assert total / (-(-total // slots) * slots) >= 0.9
        n_keys = L if window is None else window + 1
        assert n_keys / p.block_n / p.num_splits >= 4
    assert dec.default_block_n(128, 2, 3) == 128 and dec.default_block_n(256, 2, 3) == 64


def test_plan_refuses_what_the_kernel_cannot_take():
    with pytest.raises(ValueError, match="divide"):
        dec.plan((1, 1, 6, 64), (1, 100, 4, 64), "float16")
    with pytest.raises(NotImplementedError, match="head dim"):
        dec.plan((1, 1, 4, 96), (1, 100, 2, 96), "float16")
    with pytest.raises(ValueError, match="window"):
        dec.plan((1, 1, 4, 64), (1, 100, 2, 64), "float16", window=-1)
    with pytest.raises(TypeError, match="float64"):
        dec.plan((1, 1, 4, 64), (1, 100, 2, 64), "float64")


def test_jax_path_refuses_tma_with_the_reason():
    """jaxlib passes a null global-scratch pointer, which device-side descriptors need."""
    q = np.zeros((1, 1, 4, 32), np.float16)
    k = np.zeros((1, 64, 2, 32), np.float16)
    with pytest.raises(NotImplementedError, match="scratch"):
        dec.decode(q, k, k, np.array([64], np.int32), tma=True)


def test_docstring_example_runs():
    text = dec.__doc__.split("Example (CPU, interpreter)::", 1)[1]
    code = "\n".join(line[4:] for line in text.splitlines() if line.startswith("    "))
    scope = {"decode_numpy": dec.decode_numpy}
    exec(code, scope)
    assert scope["out"].shape == (1, 1, 4, 32) and np.isfinite(scope["out"]).all()
