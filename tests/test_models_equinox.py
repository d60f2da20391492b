"""Equinox's ``eqx.nn.MultiheadAttention`` under splat.sparsify: forward and gradients, the layers
in a Python loop and stacked under ``lax.scan``.

A small language model of the library's own modules (``Embedding``, ``LayerNorm``,
``MultiheadAttention`` with a causal window built from ``jnp.arange`` inside the model, ``MLP``,
``Linear``) at the size of ``model_checks``; Equinox modules take one sequence, so the batch is a
``jax.vmap``. The stacked form is Equinox's usual one for deep models: the layers' arrays made
with ``eqx.filter_vmap`` and scanned over. Equinox has no KV cache of its own, so there is no
library decode to run. Optional (the ``models`` extra): skipped, with the reason, where equinox
cannot be imported.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from tests import model_checks as mc

eqx = pytest.importorskip("equinox", reason="equinox is not installed (pip install -e '.[models]')")

pytestmark = pytest.mark.models

WINDOW = 16


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(mc.WIDTH), eqx.nn.LayerNorm(mc.WIDTH)
        self.attn = eqx.nn.MultiheadAttention(mc.HEADS, mc.WIDTH, qk_size=mc.HEAD_DIM, vo_size=mc.HEAD_DIM,
                                              key=k1)
        self.mlp = eqx.nn.MLP(mc.WIDTH, mc.WIDTH, 2 * mc.WIDTH, depth=1, activation=jax.nn.gelu, key=k2)

    def __call__(self, x):
        i = jnp.arange(x.shape[0])
        mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < WINDOW)
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h, mask=mask)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class LM(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: Block  # stacked: every array with a leading layer axis (eqx.filter_vmap)
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(mc.VOCAB, mc.WIDTH, key=k1)
        self.blocks = eqx.filter_vmap(Block)(jax.random.split(k2, mc.LAYERS))
        self.head = eqx.nn.Linear(mc.WIDTH, mc.VOCAB, key=k3)

    def __call__(self, tokens, scan: bool):
        x = jax.vmap(self.embed)(tokens)
        arrays, static = eqx.partition(self.blocks, eqx.is_array)
        if scan:
            x = jax.lax.scan(lambda h, a: (eqx.combine(a, static)(h), None), x, arrays)[0]
        else:
            for n in range(mc.LAYERS):
                x = eqx.combine(jax.tree.map(lambda a, n=n: a[n], arrays), static)(x)
        return jax.vmap(self.head)(x)


@pytest.fixture(scope="module")
def model():
    return eqx.partition(LM(jax.random.key(0)), eqx.is_array)


def _logits(scan: bool):
    def logits(params, tokens, static):
        return jax.vmap(lambda t: eqx.combine(params, static)(t, scan))(tokens)

    return logits


@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
def test_forward(model, scan):
    params, static = model
    # under lax.scan one attention (the body's) runs every layer
    layers = 1 if scan else mc.LAYERS
    mc.check_forward(lambda p, t: _logits(scan)(p, t, static), params, mc.tokens(), layers=layers)


@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
def test_grad(model, scan):
    params, static = model
    layers = 1 if scan else mc.LAYERS
    mc.check_grad(lambda p, t: _logits(scan)(p, t, static), params, mc.tokens(), layers=layers)
