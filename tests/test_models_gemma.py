"""The gemma library's Gemma 2 Transformer under splat.sparsify: forward, gradients, decode.

Optional (the ``models`` extra): skipped, with the reason, where gemma (google-deepmind/gemma
3.3) cannot be imported; where tensorflow is missing a stand-in module is put in ``sys.modules``
while gemma is imported (kauldron only checks ``isinstance`` against ``tf.Tensor``). The model
is gemma's ``Transformer`` from its own ``TransformerConfig`` with Gemma 2's alternating local
sliding-window and global layers, logit soft cap and grouped 5-D einsums, at the size of
``model_checks``. Gemma computes positions as ``cumsum(mask) - 1`` and ANDs its window on them
with a causal mask on indices (splat checks at run time that the two agree where the causal mask
lets a pair be seen). Decode runs the model against its own KV cache with the attention mask
built from the step's positions.
"""

from __future__ import annotations

import sys
import types

import jax
import jax.numpy as jnp
import pytest

from tests import model_checks as mc

pytestmark = pytest.mark.models


def _import_gemma():
    stand_in = None
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("tensorflow")
        stand_in.Tensor = type("Tensor", (), {})
        sys.modules["tensorflow"] = stand_in
    try:
        from gemma.gm.nn import _config, _modules, _transformer
    except Exception as e:  # ImportError, or an incompatible kauldron / protobuf
        pytest.skip(f"gemma cannot be imported here: {type(e).__name__}: {e}", allow_module_level=True)
    finally:
        if stand_in is not None and sys.modules.get("tensorflow") is stand_in:
            del sys.modules["tensorflow"]
    return _config, _modules, _transformer


_config, _modules, _transformer = _import_gemma()


@pytest.fixture(scope="module")
def model():
    at = _modules.AttentionType
    cfg = _config.TransformerConfig(
        num_embed=mc.VOCAB,
        embed_dim=mc.WIDTH,
        hidden_dim=2 * mc.WIDTH,
        num_heads=mc.HEADS,
        head_dim=mc.HEAD_DIM,
        num_kv_heads=mc.KV_HEADS,
        final_logit_softcap=30.0,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        attention_types=(at.LOCAL_SLIDING, at.GLOBAL),
        attn_logits_soft_cap=50.0,
        sliding_window_size=16,
    )
    m = _transformer.Transformer(config=cfg, dtype=jnp.float32)
    return m, m.init(jax.random.key(0), mc.tokens())


def _logits(m):
    def logits(params, tokens):
        return m.apply(params, tokens).logits

    return logits


def test_forward(model):
    m, params = model
    mc.check_forward(_logits(m), params, mc.tokens())


def test_grad(model):
    m, params = model
    mc.check_grad(_logits(m), params, mc.tokens())


def test_kv_cache_decode(model):
    """The local layer ANDs the causal mask on cache indices with a window on the positions the
    cache stores (0 in slots not yet written): the queries go at their positions, the keys at
    their indices, checked at run time to sit at their positions wherever the causal mask lets
    a query see them (the written slots)."""
    m, params = model
    cache = m.apply(params, batch_size=2, dtype=jnp.float32, cache_length=mc.SEQ, method=m.init_cache)

    def step(state, tokens):
        cache, end = state
        positions = end + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None].repeat(tokens.shape[0], 0)
        mask = jnp.arange(mc.SEQ)[None, None, :] <= positions[:, :, None]  # causal over the cache
        out = m.apply(params, tokens, cache=cache, positions=positions, attention_mask=mask)
        return out.logits, (out.cache, end + tokens.shape[1])

    # past the window (16) of the local layer: the window, not only the causal mask, hides keys
    toks = mc.tokens(seq=22)
    mc.check_decode(step, (cache, jnp.asarray(0, jnp.int32)), [toks[:, :20], toks[:, 20:21], toks[:, 21:22]])
