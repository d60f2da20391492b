"""Flax Linen's ``nn.MultiHeadDotProductAttention`` under splat.sparsify: forward, gradients and
``decode=True`` KV-cache steps.

A small language model of the library's own modules (embedding, two blocks of Linen's attention
with ``nn.make_causal_mask``, a dense head) at the size of ``model_checks``. In decode mode Linen
masks the cache by its index (``arange(cache) <= index``): a per-key padding that depends on the
cache, which splat takes as runtime key lengths, so each step runs splat on its one query row
(not the positions path of ``model_checks.check_decode``: the record's ``decode`` stays False).
Flax is part of the default install (the ``flax`` extra); the test is a ``models`` one for its
compile time.
"""

from __future__ import annotations

import warnings

import jax
import pytest

import splat
from tests import model_checks as mc

nn = pytest.importorskip("flax.linen", reason="flax is not installed (pip install -e '.[flax]')")

pytestmark = pytest.mark.models


class Block(nn.Module):
    decode: bool = False

    @nn.compact
    def __call__(self, x, mask=None):
        attn = nn.MultiHeadDotProductAttention(num_heads=mc.HEADS, qkv_features=mc.HEADS * mc.HEAD_DIM,
                                               decode=self.decode)
        x = x + attn(nn.LayerNorm()(x), mask=mask)
        return x + nn.Dense(mc.WIDTH)(nn.gelu(nn.Dense(2 * mc.WIDTH)(nn.LayerNorm()(x))))


class LM(nn.Module):
    decode: bool = False

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(mc.VOCAB, mc.WIDTH)(tokens)
        mask = None if self.decode else nn.make_causal_mask(tokens)  # decode: the cache's own mask
        for _ in range(mc.LAYERS):
            x = Block(self.decode)(x, mask)
        return nn.Dense(mc.VOCAB)(x)


@pytest.fixture(scope="module")
def params():
    return LM().init(jax.random.key(0), mc.tokens())


def _logits(params, tokens):
    return LM().apply(params, tokens)


def test_forward(params):
    mc.check_forward(_logits, params, mc.tokens())


def test_grad(params):
    mc.check_grad(_logits, params, mc.tokens())


def test_kv_cache_decode(params):
    model = LM(decode=True)
    cache = model.init(jax.random.key(0), mc.tokens())["cache"]

    def step(cache, tokens):
        out, new = model.apply({"params": params["params"], "cache": cache}, tokens, mutable=["cache"])
        return out, new["cache"]

    ref = cache
    toks = mc.tokens(seq=4)
    for i in range(toks.shape[1]):
        sf = splat.sparsify(step, backend="jax", fallback=False)
        with warnings.catch_warnings(), splat.call_log() as log:
            warnings.simplefilter("error", splat.SparsifyWarning)
            got, cache = jax.jit(sf)(cache, toks[:, i : i + 1])
        assert [(r.outcome, r.replaced, r.dense) for r in log] == [("splat", mc.LAYERS, 0)], log
        assert [f.runtime for f in sf.inspect(cache, toks[:, i : i + 1])] == [("kv_padding",)] * mc.LAYERS
        want, ref = jax.jit(step)(ref, toks[:, i : i + 1])
        mc.close(got, want)
        mc.close(cache, ref)
