"""The CUDA decode kernel's parts, variants and host-side plan (``jax_bindings._cuda.decode``), on CPU.

Every variant the backend can pick compiles with NVRTC (or nvcc) for sm_90a with no warning, no
stack frame and no spill: head dims 64-256, one to 32 tokens a row, GQA groups up to 32, one to
four segments, contiguous and paged caches, ids, soft cap, split or not. Variants the kernel cannot
take are refused by name. The split planner and the merge of the splits (plain JAX, run here
against a float64 merge) and the per-row tables are checked too; the kernel's numerics are
checked on a GPU (``test_cuda_decode_gpu.py``).
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

import splat
from jax_bindings import _id_runs
from jax_bindings._cuda import decode, parts
from jax_bindings._split_merge import merge_splits
from splat import masks

# (head dim, dtype, tokens, group, segments, page size, ids, soft cap, split)
VARIANTS = [
    (128, "bfloat16", 1, 4, 1, 0, False, None, True),
    (128, "bfloat16", 1, 4, 1, 16, False, None, False),
    (128, "float16", 4, 4, 2, 64, True, 50.0, True),
    (64, "bfloat16", 1, 32, 4, 0, True, None, True),
    (96, "bfloat16", 3, 8, 2, 16, False, None, True),
    (192, "float16", 2, 8, 3, 0, False, 30.0, False),
    (256, "bfloat16", 1, 4, 1, 64, False, None, True),
    (256, "bfloat16", 16, 4, 1, 0, True, None, True),
    (128, "bfloat16", 32, 2, 2, 128, False, None, True),
]


def _variant(d, dtype, tokens, group, segments, page, ids, cap, split):
    return decode.DecodeVariant(
        d, dtype, tokens, group, segments, page, ids, cap, split, decode.decode_tile(d, tokens * group)
    )


@pytest.mark.parametrize("args", VARIANTS, ids=["-".join(map(str, a)) for a in VARIANTS])
def test_every_variant_compiles_clean(args, cuda_compiler):
    prog = _variant(*args).program()
    _, log = cuda_compiler.compile(prog.source, headers=prog.header_map(), verbose=True)
    assert "warning" not in log.lower(), log
    frames = [int(x) for x in re.findall(r"(\d+) bytes stack frame", log)]
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", log)]
    assert frames and max(frames) == 0 and max(spills) == 0, log


def test_program_names_and_parts():
    a, b = (_variant(*VARIANTS[i]).program() for i in (0, 1))
    assert a.name != b.name and a.name.startswith("splat_decode_")
    headers = a.header_map()
    assert "decode_config.cuh" in headers and "common/mma_sm80.cuh" in headers
    assert "constexpr int HEAD_DIM = 128;" in headers["decode_config.cuh"]
    assert "using Elem = Bf16;" in headers["decode_config.cuh"]
    assert f"#define SPLAT_KERNEL_NAME {a.name}" in a.source
    assert "// ===== decode_config.cuh =====" in a.dump()


def test_dump_prints_the_program(monkeypatch, capsys):
    monkeypatch.setenv("SPLAT_DUMP_KERNELS", "1")
    prog = _variant(*VARIANTS[0]).program()
    assert f"# splat kernel {prog.name}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(dtype="float32"), "float32"),
        (dict(head_dim=72), "head dims"),
        (dict(head_dim=272), "head dims"),
        (dict(tokens=33), "query tokens"),
        (dict(segments=5), "segments"),
        (dict(page_size=24), "powers of two"),
    ],
)
def test_refused_variants_are_named(change, match):
    base = dict(
        zip(
            ("head_dim", "dtype", "tokens", "group", "segments", "page_size", "ids", "soft_cap", "split"),
            VARIANTS[0],
            strict=True,
        )
    )
    base.update(change)
    with pytest.raises(NotImplementedError, match=match):
        decode.DecodeVariant(**base, tile=decode.decode_tile(128, 4))


def test_bad_tiles_are_refused():
    with pytest.raises(ValueError, match="tile"):
        decode.DecodeVariant(*VARIANTS[0], decode.DecodeTile(16, 64, 1, 8, 3))  # 8 keys a warp


def test_layouts_the_walk_cannot_take_are_refused():
    with pytest.raises(NotImplementedError, match="residual"):
        decode.check_layout(splat.analyze(masks.from_fn(lambda i, j: (i * 7 + j * 3) % 11 < 2), 64, 64))
    with pytest.raises(NotImplementedError, match="grid"):
        decode.check_layout(splat.analyze(masks.neighborhood((8, 8), 5), 64, 64))
    with pytest.raises(NotImplementedError, match="square"):
        decode.check_layout(splat.analyze(masks.causal(), 32, 64))


def test_segment_rows_are_the_layouts_arrays():
    layout = splat.analyze(masks.sink(4) | masks.sliding_window(15, 0), 100, 100)
    rows = decode.segment_rows(layout).reshape(len(layout.segments), 3, 100)
    for k, s in enumerate(layout.segments):
        assert (
            (rows[k, 0] == s.base).all() and (rows[k, 1] == s.stride).all() and (rows[k, 2] == s.count).all()
        )
    assert decode.max_keys(layout) == 4 + 16


@pytest.mark.parametrize("ctas, tiles", [(64, 513), (8, 2049), (512, 129), (64, 65), (1, 1), (4096, 4)])
def test_split_plan_fills_the_gpu_without_idle_waves(ctas, tiles):
    s = decode.choose_splits(ctas, tiles, 132)
    assert 1 <= s <= max(1, tiles)
    slots = 132 * 2
    if ctas >= slots:
        assert s == 1  # enough CTAs already: no merge
    else:
        assert ctas * s >= min(slots // 2, ctas * tiles)  # at least half the GPU busy where the work allows


def test_merge_of_splits_matches_float64():
    rng = np.random.default_rng(0)
    b, t, h, s, d = 2, 3, 4, 5, 8
    o = rng.standard_normal((b, t, h, s, d)).astype(np.float32)
    lse = rng.standard_normal((b, t, h, s)).astype(np.float32) * 3
    lse[0, 0, 0, :] = -np.inf  # a row no split saw: 0, -inf
    lse[1, 2, 3, 1:] = -np.inf  # one split only
    out, got_lse = merge_splits(jnp.asarray(o), jnp.asarray(lse), jnp.float32)
    top = np.max(lse, -1, keepdims=True)
    w = np.where(np.isfinite(lse), np.exp(lse - np.where(np.isfinite(top), top, 0)), 0)
    den = w.sum(-1)
    ref = np.where(den[..., None] > 0, (o * w[..., None]).sum(-2) / np.where(den > 0, den, 1)[..., None], 0)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-6)
    assert (np.asarray(out)[0, 0, 0] == 0).all() and np.isneginf(np.asarray(got_lse)[0, 0, 0])
    np.testing.assert_allclose(np.asarray(out)[1, 2, 3], o[1, 2, 3, 0], rtol=1e-6)
    assert got_lse.shape == (b, h, t)


def test_constants_header_refuses_other_types():
    with pytest.raises(TypeError, match="X"):
        parts.constants_header("cfg", {"X": "text"})
    text = parts.constants_header("cfg", {"A": 3, "B": True, "C": 0.5})
    assert all(
        x in text for x in ("constexpr int A = 3;", "constexpr bool B = true;", "constexpr float C = 0.5f;")
    )


def test_kernel_files_are_package_data():
    names = [n for n, _ in parts._files()]
    assert {
        "decode/decode.cu",
        "decode/key_walk.cuh",
        "decode/kv_rows.cuh",
        "common/mma_sm80.cuh",
        "common/types.cuh",
    } <= set(names)
    assert all(parts.read(n) == t for n, t in parts._files())


def test_document_keys_cut_sorted_rows_to_the_querys_document():
    from jax_bindings._runtime import RuntimeMask

    kv_ids = np.array(
        [[0] * 5 + [1] * 7 + [2] * 4, [2, 0, 1, 1, 0, 2, 2, 1, 0, 0, 1, 2, 0, 1, 2, 0]], np.int32
    )
    q_ids = np.array([[1, 2], [1, 0]], np.int32)
    exact = np.array([1, 0], np.int32)
    rt = RuntimeMask(
        jnp.ones(2, jnp.int32),
        jnp.full(2, 16, jnp.int32),
        jnp.asarray(exact),
        jnp.asarray(q_ids),
        jnp.asarray(kv_ids),
        jnp.zeros((2, 2), jnp.int32),
    )
    keys = np.asarray(_id_runs.document_keys(rt, 16))
    assert keys.tolist() == [[[5, 12], [12, 16]], [[0, 16], [0, 16]]]  # unsorted row: every key, ids tested
