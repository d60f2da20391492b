"""Optional: splat.sparsify on the gemma library's own Transformer (random init, tiny config).

Marked ``gemma``; skipped, with the reason, where gemma (google-deepmind/gemma 3.3.0) cannot be
imported. Not part of the default requirements. gemma 3.3.0 imports kauldron, whose
``kauldron.typing`` imports tensorflow only for ``isinstance`` checks against ``tf.Tensor``;
where tensorflow is missing, a stand-in module holding an empty ``Tensor`` class is put in
``sys.modules`` while gemma is imported, and removed afterwards. What it took to run here is in
examples/README.md ("sparsify on gemma").

The model has a local sliding-window layer and a global layer, grouped KV heads, a logit soft cap
and a padded batch row. The global layer's attention (causal AND the token padding mask) runs
through splat with the padding as a runtime argument; the local layer ANDs a causal mask on
indices with a window on positions computed from the tokens (a cumulative sum): splat takes it
where the positions equal the indices, checked at run time (``positions=indices``; the padded
row's positions do not, so that call runs the original attention). The logits match the
unmodified model.
"""

import sys
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splat
from splat._sparsify import SparsifyWarning, sparsify

pytestmark = pytest.mark.gemma


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
    except Exception as e:  # ImportError, or an incompatible kauldron / typeguard
        pytest.skip(
            f"gemma's Transformer cannot be imported here: {type(e).__name__}: {e}", allow_module_level=True
        )
    finally:
        if stand_in is not None and sys.modules.get("tensorflow") is stand_in:
            del sys.modules["tensorflow"]
    return _config, _modules, _transformer


_config, _modules, _transformer = _import_gemma()

VOCAB, LEN, WINDOW, CAP = 64, 16, 4, 5.0


@pytest.fixture(scope="module")
def model_and_inputs():
    at = _modules.AttentionType
    cfg = _config.TransformerConfig(
        num_embed=VOCAB,
        embed_dim=32,
        hidden_dim=64,
        num_heads=4,
        head_dim=8,
        num_kv_heads=2,
        final_logit_softcap=None,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        attention_types=(at.LOCAL_SLIDING, at.GLOBAL),
        attn_logits_soft_cap=CAP,
        sliding_window_size=WINDOW,
    )
    model = _transformer.Transformer(config=cfg, dtype=jnp.float32)
    tokens = np.random.default_rng(0).integers(1, VOCAB, (2, LEN))
    tokens[1, 11:] = 0  # gemma's padding token: the second row is padded on the right
    tokens = jnp.asarray(tokens, jnp.int32)
    params = model.init(jax.random.key(0), tokens)
    # random-init scores are tiny; larger query/key weights make the soft cap and the masks matter
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 6.0 if any("q_einsum" in str(p) or "kv_einsum" in str(p) for p in path) else x,
        params,
    )

    def logits(params, tokens):
        return model.apply(params, tokens).logits

    return logits, params, tokens


def test_gemma_transformer_logits_match(model_and_inputs):
    logits, params, tokens = model_and_inputs
    sf = sparsify(logits, backend="jax")
    found = sf.inspect(params, tokens)
    assert sf.problems(params, tokens) == []
    local, glob = found
    assert local.mask == splat.masks.sliding_window(WINDOW - 1, 0)
    assert local.runtime == ("kv_padding", "positions=indices")
    assert glob.mask == splat.masks.causal()
    assert glob.runtime == ("kv_padding",)
    assert all(f.soft_cap == pytest.approx(CAP) and f.heads == (2, 2) for f in found)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        got = jax.jit(sf)(params, tokens)
    assert not any(issubclass(w.category, SparsifyWarning) for w in rec)
    want = np.asarray(jax.jit(logits)(params, tokens))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
