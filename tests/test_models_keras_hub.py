"""keras-hub's causal LMs (``KERAS_BACKEND=jax``) under splat.sparsify: forward, gradients, decode.

Optional (the ``models`` extra): skipped, with the reason, where keras-hub cannot be imported
with the JAX backend. The backbones are built from their own constructors (Gemma with alternating
sliding-window and global layers and logit soft caps, Gemma3, Llama, Mistral with a sliding
window) at the size of ``model_checks``. The forward pass and its gradient run through
``backbone.stateless_call`` with the padding mask as an input (a runtime key padding term);
decode runs ``CausalLM.call_with_cache`` at a traced cache index, which keras-hub adds to a float
``arange`` of the queries: splat takes it as the queries' runtime positions.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest

from tests import model_checks as mc

if os.environ.setdefault("KERAS_BACKEND", "jax") != "jax":
    pytest.skip("keras runs another backend here (KERAS_BACKEND is set)", allow_module_level=True)
keras_hub = pytest.importorskip("keras_hub", reason="keras-hub is not installed (pip install -e '.[models]')")
import keras  # noqa: E402

if keras.backend.backend() != "jax":
    pytest.skip(f"keras was imported with the {keras.backend.backend()} backend", allow_module_level=True)

pytestmark = pytest.mark.models

_COMMON = dict(
    vocabulary_size=mc.VOCAB,
    num_layers=mc.LAYERS,
    num_query_heads=mc.HEADS,
    num_key_value_heads=mc.KV_HEADS,
    hidden_dim=mc.WIDTH,
    intermediate_dim=2 * mc.WIDTH,
    dtype="float32",
)


def _gemma():
    bb = keras_hub.models.GemmaBackbone(
        **_COMMON,
        head_dim=mc.HEAD_DIM,
        use_sliding_window_attention=True,
        sliding_window_size=16,
        attention_logit_soft_cap=50.0,
        final_logit_soft_cap=30.0,
        use_post_ffw_norm=True,
        use_post_attention_norm=True,
        query_head_dim_normalize=True,
    )
    return keras_hub.models.GemmaCausalLM(backbone=bb, preprocessor=None)


def _gemma3():
    bb = keras_hub.models.Gemma3Backbone(
        **_COMMON, head_dim=mc.HEAD_DIM, sliding_window_size=16, image_size=16, vision_encoder=None
    )
    return keras_hub.models.Gemma3CausalLM(backbone=bb, preprocessor=None)


def _llama():
    return keras_hub.models.LlamaCausalLM(
        backbone=keras_hub.models.LlamaBackbone(**_COMMON), preprocessor=None
    )


def _mistral():
    bb = keras_hub.models.MistralBackbone(**_COMMON, sliding_window=16)
    return keras_hub.models.MistralCausalLM(backbone=bb, preprocessor=None)


MODELS = {"gemma": _gemma, "gemma3": _gemma3, "llama": _llama, "mistral": _mistral}


@pytest.fixture(scope="module", params=list(MODELS))
def lm(request):
    keras.utils.set_random_seed(0)
    return MODELS[request.param]()


def _forward(lm):
    bb = lm.backbone
    ntv = [v.value for v in bb.non_trainable_variables]

    def hidden(tv, tokens, padding):
        out, _ = bb.stateless_call(tv, ntv, {"token_ids": tokens, "padding_mask": padding})
        return out

    return hidden, [v.value for v in bb.trainable_variables]


def test_forward(lm):
    hidden, tv = _forward(lm)
    toks = mc.tokens()
    mc.check_forward(hidden, tv, toks, jnp.ones(toks.shape, bool))


def test_grad(lm):
    hidden, tv = _forward(lm)
    toks = mc.tokens()
    mc.check_grad(hidden, tv, toks, jnp.ones(toks.shape, bool))


_DECODE = [
    "gemma",  # its sliding band's rows sliced at the cache index: the band at the query positions
    "gemma3",
    "llama",
    "mistral",  # a float and an integer query position array, both arange + the cache index
]


@pytest.mark.parametrize("name", _DECODE)
def test_kv_cache_decode(name):
    keras.utils.set_random_seed(0)
    lm = MODELS[name]()
    toks = mc.tokens()
    if isinstance(lm, keras_hub.models.Gemma3CausalLM):
        cache = lm._build_cache(toks, None, None, jnp.ones(toks.shape, bool), None)[-1]
    else:
        cache = lm._build_cache(toks)[1]
    cache = jax.tree.map(jnp.zeros_like, cache)

    def step(state, tokens):
        cache, index = state
        logits, _, cache = lm.call_with_cache(tokens, cache, index)
        return logits, (cache, index + tokens.shape[1])

    state = (cache, jnp.asarray(0, jnp.int32))
    mc.check_decode(step, state, [toks[:, :8], toks[:, 8:9], toks[:, 9:10]])
