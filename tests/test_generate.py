"""examples.generate: greedy tokens through splat's KV cache (contiguous and paged) equal the dense model's.

CPU, float32, small: 2 layers (a causal window of 16 keys, then global causal), 4 query heads on
2 KV heads, a 40-token prompt (the window cuts it) and 12 decode steps.
"""

import dataclasses
import json
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples import generate
from examples.common import GPTConfig
from examples.gpt_jax import _block, _embed, _logits

B, P, N, KV_HEADS = 2, 40, 12, 2
CFG = GPTConfig(vocab=64, layers=2, width=64, heads=4, seq_len=P + N, window=16)


@pytest.fixture(scope="module")
def model():
    """``(params, prompt, dense tokens [B, N + 1])``: the reference, run once for the module."""
    params = generate.init_params(CFG, KV_HEADS, seed=3)
    prompt = jnp.asarray(np.random.default_rng(3).integers(0, CFG.vocab, (B, P)), jnp.int32)
    dense = generate.Generator(CFG, generate.make_peer("dense", CFG), B)
    return params, prompt, np.asarray(dense.generate(params, prompt, N))


def _full_logits(params, tokens, cfg):
    """Logits ``[B, S, vocab]`` of the whole sequence, no cache: the dense peer's prefill attention."""
    peer = generate.make_peer("dense", cfg)
    emb, x = _embed(params, tokens, jnp.arange(tokens.shape[1]), jnp.float32)
    for i, blk in enumerate(params["blocks"]):
        x = _block(x, blk, lambda q, k, v, i=i: peer.prefill(i, q, k, v), jnp.float32)
    return _logits(params, x, emb, jnp.float32)


def test_gqa_params():
    params = generate.init_params(CFG, KV_HEADS, seed=0)
    blk = params["blocks"][0]
    assert blk["q"]["kernel"].shape == (64, 4, 16) and blk["k"]["kernel"].shape == (64, 2, 16)
    assert blk["v"]["bias"].shape == (2, 16)
    with pytest.raises(ValueError, match="divisor"):
        generate.init_params(CFG, 3)


def test_dense_reference_is_the_full_sequence_argmax(model):
    """The reference itself: each generated token is the argmax of the uncached full-sequence logits."""
    params, prompt, dense = model
    seq = jnp.concatenate([prompt, jnp.asarray(dense[:, :-1])], axis=1)  # [B, P + N]: every input
    want = np.asarray(_full_logits(params, seq, CFG)[:, P - 1 :].argmax(-1))
    np.testing.assert_array_equal(dense, want)


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged16"])
def test_splat_tokens_equal_dense(model, page_size):
    params, prompt, dense = model
    gen = generate.Generator(CFG, generate.make_peer("splat", CFG, page_size=page_size), B, seed=1)
    if page_size is not None:  # a shuffled table over a pool of B * ceil(52 / 16) = 8 pages
        assert gen.page_table.shape == (B, 4) and sorted(np.asarray(gen.page_table).ravel()) == list(range(8))
    tokens = np.asarray(gen.generate(params, prompt, N))
    assert tokens.shape == (B, N + 1)
    np.testing.assert_array_equal(tokens, dense)
    assert len(np.unique(tokens)) > 2  # the tokens vary: the comparison has something to compare


def test_tokens_depend_on_the_window(model):
    """The control: one more key in the window layers' view changes the greedy tokens."""
    params, prompt, dense = model
    wider = dataclasses.replace(CFG, window=CFG.window + 1)
    tokens = np.asarray(
        generate.Generator(wider, generate.make_peer("dense", wider), B).generate(params, prompt, N)
    )
    assert (tokens != dense).any()


def test_decode_compiles_once_and_donates_the_caches(model):
    params, prompt, dense = model
    gen = generate.Generator(CFG, generate.make_peer("splat", CFG), B)
    other = jnp.asarray(np.random.default_rng(9).integers(0, CFG.vocab, (B, P)), jnp.int32)
    first, caches = gen.prefill(params, other, gen.page_table)
    tokens, new = gen.decode(params, caches, first, P, N)
    assert all(c.is_deleted() for kv in caches for c in kv)  # donated: updated in place
    assert not any(c.is_deleted() for kv in new for c in kv)
    np.testing.assert_array_equal(
        np.asarray(gen.generate(params, prompt, N)), dense
    )  # new tokens, same shapes
    assert gen.traces == {"prefill": 1, "step": 1}  # one trace for every prompt, token and position
    assert gen._decode._cache_size() == 1
    assert tokens.shape == (B, N)


def test_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "gen.json"
    argv = "--batch 2 --prompt 24 --new-tokens 6 --layers 2 --width 32 --heads 4 --kv-heads 2 --window 8"
    res = generate.main(
        [*argv.split(), "--vocab", "64", "--paged", "16", "--repeats", "2", "--out", str(out)]
    )
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(res))
    assert saved["checked"] and saved["tokens_match"] is True  # --check is the default on a CPU
    assert (
        saved["config"]["kv_heads"] == 2
        and saved["config"]["head_dim"] == 8
        and saved["config"]["paged"] == 16
    )
    assert set(saved["runs"]) == {"splat", "dense"}
    splat_run = saved["runs"]["splat"]
    assert splat_run["cache"] == "paged(16)" and splat_run["traces"] == {"prefill": 1, "step": 1}
    assert np.asarray(splat_run["tokens"]).shape == (2, 7)
    for r in saved["runs"].values():
        assert r["ttft_ms"] > 0 and r["decode_tokens_per_s"] > 0 and r["step_ms"] > 0
    table = capsys.readouterr().out
    assert "decode tok/s" in table and "paged(16)" in table


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the refusal where there is no GPU")
def test_gpu_peers_refuse_with_the_reason(monkeypatch):
    with pytest.raises(SystemExit, match="--peer cudnn cannot run here: cuDNN attention needs a CUDA GPU"):
        generate.main(["--peer", "cudnn"])
    monkeypatch.setitem(sys.modules, "flash_attn3_jax", None)  # import fails
    with pytest.raises(SystemExit, match="--peer fa3 cannot run here: flash_attn3_jax is not installed"):
        generate.main(["--peer", "fa3"])


# -- the fa3 peer against a fake flash_attn3_jax that computes what FlashAttention documents -------------


def _fa_attention(q, k, v, kv_len, scale, is_causal, window_size):
    """FlashAttention's masks: query ``i`` of ``Sq`` sits at ``kv_len - Sq + i`` (bottom-right) and sees
    keys ``j < kv_len`` in ``[pos - left, pos + right]`` (``-1``: unbounded; causal: ``right = 0``)."""
    sq, length = q.shape[1], k.shape[1]
    pos = (kv_len[:, None] - sq + jnp.arange(sq))[:, :, None]  # [B, Sq, 1]
    j = jnp.arange(length)[None, None, :]
    left, right = window_size
    right = 0 if is_causal else right
    ok = j < kv_len[:, None, None]
    if left >= 0:
        ok &= j >= pos - left
    if right >= 0:
        ok &= j <= pos + right
    return jax.nn.dot_product_attention(q, k, v, mask=ok[:, None], scale=scale)


def _fake_fa3(calls: list) -> types.ModuleType:
    mod = types.ModuleType("flash_attn3_jax")

    def flash_mha(q, k, v, softmax_scale=None, is_causal=False, window_size=(-1, -1)):
        calls.append(("flash_mha", is_causal, window_size))
        lens = jnp.full((q.shape[0],), k.shape[1], jnp.int32)
        return _fa_attention(q, k, v, lens, softmax_scale, is_causal, window_size)

    def flash_mha_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=None, page_table=None, softmax_scale=None, is_causal=False,
        window_size=(-1, -1),
    ):  # fmt: skip
        calls.append(("flash_mha_with_kvcache", is_causal, window_size, page_table is not None))
        if page_table is not None:  # [num_pages, page_size, Hk, D] -> each row's [L, Hk, D]
            b, (hk, d) = q.shape[0], k_cache.shape[2:]
            k_cache, v_cache = (c[page_table].reshape(b, -1, hk, d) for c in (k_cache, v_cache))
        return _fa_attention(q, k_cache, v_cache, cache_seqlens, softmax_scale, is_causal, window_size)

    mod.flash_mha, mod.flash_mha_with_kvcache = flash_mha, flash_mha_with_kvcache
    return mod


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged16"])
def test_fa3_peer_with_a_fake_module(model, monkeypatch, page_size):
    """The fa3 peer's calls (windows, cache_seqlens, page table) on a jnp stand-in: the dense tokens."""
    params, prompt, dense = model
    calls: list = []
    monkeypatch.setitem(sys.modules, "flash_attn3_jax", _fake_fa3(calls))
    monkeypatch.setattr(generate, "_need_gpu", lambda what, cfg: None)  # a CPU passing for a GPU
    peer = generate.make_peer("fa3", CFG, page_size=page_size)
    tokens = np.asarray(generate.Generator(CFG, peer, B).generate(params, prompt, N))
    np.testing.assert_array_equal(tokens, dense)
    paged = page_size is not None
    assert set(calls) == {  # traced once each: layer 0 the window, layer 1 global
        ("flash_mha", True, (15, 0)),
        ("flash_mha", True, (-1, -1)),
        ("flash_mha_with_kvcache", True, (15, 0), paged),
        ("flash_mha_with_kvcache", True, (-1, -1), paged),
    }


def test_docstring_example_runs():
    import doctest

    result = doctest.testmod(generate)
    assert result.attempted >= 6 and result.failed == 0
