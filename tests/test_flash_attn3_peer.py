"""The FlashAttention-3 bench peer, on the CPU through a fake ``flash_attn3_jax`` written in jnp.

The fake computes what FlashAttention documents for ``flash_mha(q, k, v, softmax_scale=None,
is_causal=False, window_size=(-1, -1))``: query ``i`` sees keys ``i - left <= j <= i + right``
(``-1``: unbounded; ``is_causal`` makes ``right`` 0). Comparing its output with the float64
reference of splat's mask shows that the peer's window arguments are exactly the mask.
"""

from __future__ import annotations

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import assert_close, attention_dense_grads, attention_grads_ref, attention_ref

import splat
from splat import catalogue, masks
from splat.tools import bench, peers
from splat.tools.mask_forms import flash_attn3_arguments
from splat.tools.peers import PEERS, PeerUnavailable, Problem

D = 128  # the head dim FlashAttention-3's Hopper build runs


def _fa_visible(q_len: int, kv_len: int, is_causal: bool, window_size) -> np.ndarray:
    """FlashAttention's documented mask for these arguments (bottom-right aligned), in numpy."""
    left, right = window_size
    if is_causal:
        right = 0
    i = np.arange(q_len)[:, None] + (kv_len - q_len)
    j = np.arange(kv_len)[None, :]
    ok = np.ones((q_len, kv_len), bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def _fake_module(calls: list) -> types.ModuleType:
    mod = types.ModuleType("flash_attn3_jax")

    def flash_mha(q, k, v, softmax_scale=None, is_causal=False, window_size=(-1, -1)):
        calls.append({"softmax_scale": softmax_scale, "is_causal": is_causal, "window_size": window_size})
        assert q.ndim == 4 and q.shape[-1] == D, q.shape  # [B, S, H, D]
        ok = jnp.asarray(_fa_visible(q.shape[1], k.shape[1], is_causal, window_size))
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
        p = jax.nn.softmax(jnp.where(ok, s, -jnp.inf), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v)

    mod.flash_mha = flash_mha
    return mod


@pytest.fixture
def fake_fa3(monkeypatch):
    """A fake flash_attn3_jax in sys.modules, on a machine that passes for a Hopper GPU; its calls."""
    calls: list = []
    monkeypatch.setitem(sys.modules, "flash_attn3_jax", _fake_module(calls))
    monkeypatch.setattr(peers, "_hopper", lambda: True)
    return calls


def _problem(mask, s, mode, dtype="bfloat16", d=D, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((1, s, 2, d), dtype=np.float32) for _ in range(4))
    return Problem(q, k, v, do, mask, splat.analyze(mask, q_len=s, kv_len=s), dtype, mode, "jax")


# the band masks FlashAttention-3 computes, at odd S: full, causal, causal windows, (left, right) windows
BANDS = {
    "full": masks.full(),
    "causal": masks.causal(),
    "causal_window": masks.sliding_window(6, 0),
    "window": masks.sliding_window(4, 4),
    "left_heavy": masks.sliding_window(9, 2),
    "right_heavy": masks.sliding_window(1, 7),
    "causal_as_intersection": masks.causal() & masks.sliding_window(5),
}


@pytest.mark.parametrize("s", [1, 2, 37, 61])
@pytest.mark.parametrize("name", list(BANDS))
def test_flash_attn3_arguments_are_exactly_the_mask(name, s):
    layout = BANDS[name].to_acsr(s, s)
    kw = flash_attn3_arguments(layout)
    assert kw is not None
    np.testing.assert_array_equal(_fa_visible(s, s, **kw), layout.to_dense())


def test_flash_attn3_arguments_written_as_flash_attention_would():
    s = 37
    assert flash_attn3_arguments(masks.full().to_acsr(s)) == {"is_causal": False, "window_size": (-1, -1)}
    assert flash_attn3_arguments(masks.causal().to_acsr(s)) == {"is_causal": True, "window_size": (-1, -1)}
    assert flash_attn3_arguments(masks.sliding_window(6, 0).to_acsr(s)) == {
        "is_causal": True,
        "window_size": (6, 0),
    }
    assert flash_attn3_arguments(masks.sliding_window(9, 2).to_acsr(s)) == {
        "is_causal": False,
        "window_size": (9, 2),
    }
    assert flash_attn3_arguments(masks.sliding_window(3, 40).to_acsr(s)) == {
        "is_causal": False,
        "window_size": (3, -1),
    }


NOT_BANDS = [n for n in catalogue.SMALL if n not in ("full", "causal", "sliding_window", "causal_window")]


@pytest.mark.parametrize("name", NOT_BANDS)
def test_flash_attn3_arguments_refuse_other_masks(name):
    assert flash_attn3_arguments(catalogue.SMALL[name].to_acsr(61, 61)) is None
    assert flash_attn3_arguments(masks.causal().to_acsr(40, 61)) is None  # not square


@pytest.mark.parametrize(
    "name, mode",
    [
        ("causal_window", "fwd"),
        ("causal_window", "fwdbwd"),
        ("right_heavy", "fwdbwd"),
        ("left_heavy", "fwd"),
        ("causal", "fwd"),
        ("full", "fwd"),
    ],
)
def test_flash_attn3_peer_matches_the_float64_reference(fake_fa3, name, mode):
    p = _problem(BANDS[name], 37, mode, seed=len(name))
    prepared = PEERS["flash_attn3"].prepare(p)
    assert fake_fa3 and all(c == fake_fa3[0] for c in fake_fa3)
    assert fake_fa3[0]["softmax_scale"] == pytest.approx(D**-0.5)
    q, k, v, do = (jnp.asarray(a, jnp.bfloat16) for a in (p.q, p.k, p.v, p.do))
    mask, scale = p.layout.to_dense(), D**-0.5
    want, _ = attention_ref(q, k, v, mask, scale)
    same_out, same_grads = attention_dense_grads(q, k, v, mask, scale, do)
    got = prepared.outputs()
    if mode == "fwd":
        assert_close(f"{name} out", got, want, jnp.bfloat16, same_out)
        return
    out, grads = got
    assert_close(f"{name} out", out, want, jnp.bfloat16, same_out)
    want_grads = attention_grads_ref(q, k, v, mask, scale, do)
    for g, w, same, what in zip(grads, want_grads, same_grads, "qkv", strict=True):
        assert_close(f"{name} d{what}", g, w, jnp.bfloat16, same)


@pytest.mark.parametrize(
    "mask, dtype, d, why",
    [
        (masks.dilated_window(6, 2), "bfloat16", D, "only full, causal and"),
        (masks.global_tokens(2) | masks.sliding_window(3), "bfloat16", D, "only full, causal and"),
        (masks.causal(), "float32", D, "float16/bfloat16 only"),
        (masks.causal(), "bfloat16", 64, "head dim"),
    ],
)
def test_flash_attn3_peer_says_why_it_skips(fake_fa3, mask, dtype, d, why):
    with pytest.raises(PeerUnavailable, match=why):
        PEERS["flash_attn3"].prepare(_problem(mask, 37, "fwd", dtype, d))
    assert not fake_fa3


def test_flash_attn3_needs_its_module_and_a_hopper_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn3_jax", None)  # import fails
    with pytest.raises(PeerUnavailable, match="flash_attn3_jax is not installed"):
        PEERS["flash_attn3"].prepare(_problem(masks.causal(), 37, "fwd"))
    monkeypatch.setitem(sys.modules, "flash_attn3_jax", _fake_module([]))
    if jax.default_backend() != "gpu":
        with pytest.raises(PeerUnavailable, match="Hopper"):
            PEERS["flash_attn3"].prepare(_problem(masks.causal(), 37, "fwd"))


def test_flash_attn3_in_a_bench_run(fake_fa3):
    """Timed like the other JAX peers and checked against splat's output, forward and forward+backward."""
    tiny = {"window": masks.sliding_window(3, 6)}
    cfg = bench.BenchConfig(
        lengths=(37,),
        heads=1,
        head_dim=D,
        dtype="bfloat16",
        mode="both",
        peers=("splat", "flash_attn3"),
        warmup=0,
        repeats=1,
    )
    result = bench.run_bench(cfg, tiny, log=lambda s: None)
    rows = {(r["pattern"], r["mode"], r["impl"]): r for r in result["results"]}
    assert set(rows) == {("window", m, i) for m in ("fwd", "fwdbwd") for i in ("splat", "flash_attn3")}
    for mode in ("fwd", "fwdbwd"):
        fa, sp = rows[("window", mode, "flash_attn3")], rows[("window", mode, "splat")]
        assert fa["agrees"] is True and fa["vs_splat"] > 0
        assert (fa["timing"], fa["calls_per_launch"]) == (sp["timing"], sp["calls_per_launch"])
        assert fa["splat_backend"] is None and isinstance(sp["splat_backend"], str)
    assert rows[("window", "fwd", "flash_attn3")]["note"] == "is_causal=False, window=(3, 6)"
    assert result["disagreements"] == [] and result["skipped"] == []
