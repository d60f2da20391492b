"""penzai's transformer variants under splat.sparsify: forward, gradients and KV-cache decode.

Optional (the ``models`` extra): skipped, with the reason, where penzai cannot be imported. The
models are built from penzai's configs (a Gemma-2-style one with alternating sliding and global
layers, logit soft caps and tied embeddings; Llama; Mistral with a sliding window; GPT-NeoX),
at the size of ``model_checks``. Penzai writes attention with named axes (``nmap``: nested
``vmap``s) and, in decode, builds its mask from the ``token_positions`` side input, which splat
takes as runtime positions.
"""

from __future__ import annotations

import jax
import pytest

from tests import model_checks as mc

pz = pytest.importorskip("penzai.pz", reason="penzai is not installed (pip install -e '.[models]')")
from penzai.models.transformer import sampling_mode  # noqa: E402
from penzai.models.transformer.variants import gpt_neox, llamalike_common  # noqa: E402

pytestmark = pytest.mark.models


def _llamalike(**kw):
    base = dict(
        num_kv_heads=mc.KV_HEADS,
        query_head_multiplier=mc.HEADS // mc.KV_HEADS,
        embedding_dim=mc.WIDTH,
        projection_dim=mc.HEAD_DIM,
        mlp_hidden_dim=2 * mc.WIDTH,
        num_decoder_blocks=mc.LAYERS,
        vocab_size=mc.VOCAB,
        mlp_variant="swiglu",
        tie_embedder_and_logits=False,
    )
    return llamalike_common.build_llamalike_transformer(
        llamalike_common.LlamalikeTransformerConfig(**(base | kw)), init_base_rng=jax.random.key(0)
    )


def _gemma2():
    return _llamalike(
        mlp_variant="geglu_approx",
        tie_embedder_and_logits=True,
        attention_type=(
            llamalike_common.AttentionTypeSlidingWindowCausal(16),
            llamalike_common.AttentionTypeGlobalCausal(),
        ),
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        final_logit_softcap=30.0,
        attn_logits_soft_cap=50.0,
        query_scaling_factor=mc.HEAD_DIM**-0.5,
    )


def _gpt_neox():
    cfg = gpt_neox.GPTNeoXTransformerConfig(
        num_attention_heads=mc.HEADS,
        embedding_dim=mc.WIDTH,
        projection_dim=mc.HEAD_DIM,
        mlp_hidden_dim=2 * mc.WIDTH,
        num_decoder_blocks=mc.LAYERS,
        vocab_size=mc.VOCAB,
        activation_fn="gelu_exact",
        rope_subset_size=mc.HEAD_DIM // 4,
        rope_wavelength=10_000.0,
        layernorm_epsilon=1e-5,
        parameter_dtype=jax.numpy.float32,
        activation_dtype=jax.numpy.float32,
    )
    return gpt_neox.build_gpt_neox_transformer(cfg, init_base_rng=jax.random.key(0))


MODELS = {
    "gemma2": _gemma2,
    "llama": lambda: _llamalike(),
    "mistral": lambda: _llamalike(attention_type=llamalike_common.AttentionTypeSlidingWindowCausal(16)),
    "gpt_neox": _gpt_neox,
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


def _forward(model):
    unbound, params = pz.unbind_params(model, freeze=True)

    def logits(params, tokens):
        m = pz.bind_variables(unbound, params)
        return m(pz.nx.wrap(tokens).tag("batch", "seq")).unwrap("batch", "seq", "vocabulary")

    return logits, params


def test_forward(model):
    logits, params = _forward(model)
    mc.check_forward(logits, params, mc.tokens())


def test_grad(model):
    logits, params = _forward(model)
    mc.check_grad(logits, params, mc.tokens())


def test_kv_cache_decode(model):
    sampler = sampling_mode.KVCachingTransformerLM.from_uncached(
        model, cache_len=mc.SEQ, batch_axes={"batch": 2}
    )
    unbound, state = pz.unbind_variables(sampler, freeze=True)

    def step(state, tokens):
        m = pz.bind_variables(unbound, state, unfreeze_as_copy=True)
        out = m(pz.nx.wrap(tokens).tag("batch", "seq")).unwrap("batch", "seq", "vocabulary")
        return out, pz.freeze_variables(pz.unbind_variables(m)[1])

    toks = mc.tokens(seq=12)
    mc.check_decode(step, state, [toks[:, :8], toks[:, 8:9], toks[:, 9:10]])
