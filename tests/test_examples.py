"""The example models train, splat matches the dense twin, the pure-JAX GPT equals the Flax one."""

import dataclasses
import json
import pathlib
import subprocess
import sys

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples import bench_train, gpt_jax
from examples import train as train_mod
from examples.common import make_packed_batch
from examples.models import GPTConfig, LongformerConfig, build
from examples.train import loss_fn, make_batch, train

GPT_CFG = GPTConfig(vocab=32, layers=2, width=32, heads=2, seq_len=64, window=8)
LF_CFG = LongformerConfig(vocab=32, layers=2, width=32, heads=2, seq_len=64, window=4, global_tokens=2)


@pytest.mark.parametrize("cfg", [GPT_CFG, LF_CFG], ids=["gpt", "longformer"])
def test_trains_and_loss_falls(cfg):
    res = train(cfg, attention="splat", steps=25, batch=4, lr=3e-3, quiet=True)
    losses = res["losses"]
    assert np.all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < losses[0] - 0.2, losses
    assert res["tokens_per_s"] > 0


@pytest.mark.parametrize("cfg", [GPT_CFG, LF_CFG], ids=["gpt", "longformer"])
def test_splat_gradients_match_dense_twin(cfg):
    sp, de = build(cfg, "splat", seed=1), build(cfg, "dense", seed=1)
    for a, b in zip(
        jax.tree.leaves(nnx.state(sp, nnx.Param)), jax.tree.leaves(nnx.state(de, nnx.Param)), strict=False
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # identical parameters
    batch = make_batch(cfg, np.random.default_rng(2), 2)
    ls, gs = nnx.value_and_grad(loss_fn)(sp, *batch)
    ld, gd = nnx.value_and_grad(loss_fn)(de, *batch)
    assert float(ls) == pytest.approx(float(ld), rel=1e-5)
    for a, b in zip(jax.tree.leaves(gs), jax.tree.leaves(gd), strict=False):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-5)


def test_train_cli(capsys):
    out = train_mod.main(
        "--model longformer --layers 1 --width 16 --heads 2 --seq-len 32 --window 4 --steps 3 "
        "--batch 2".split()
    )
    assert out["attention"] == "splat" and np.isfinite(out["final_loss"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["model"] == "longformer"


def test_bench_train_tiny(capsys):
    res = bench_train.main(
        "--layers 2 --width 32 --heads 2 --seq-len 64 --window 8 --dtype float32 --steps 4 --vocab 32 "
        "--modes splat,xla".split()
    )
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in (
        "benchmark",
        "device",
        "platform",
        "versions",
        "config",
        "results",
        "ratio_vs_splat",
        "loss_dev",
    ):
        assert key in printed
    assert printed["modes"] == ["splat", "xla"]
    for mode in ("splat", "xla"):
        r = res["results"][mode]
        assert len(r["losses"]) == 4 and np.all(np.isfinite(r["losses"]))
        assert 0 < r["step_ms_min"] <= r["step_ms"] and r["tokens_per_s"] > 0 and r["first_step_s"] > 0
    assert res["ratio_vs_splat"]["xla"] > 0
    assert res["loss_dev"]["xla"]["max_abs_dev"] < 1e-3
    assert res["results"]["splat"]["losses"][0] == pytest.approx(np.log(32), rel=0.2)


def test_bench_train_records_a_failing_mode(capsys):
    if jax.default_backend() == "gpu":
        pytest.skip("cuDNN runs here; the failing mode is CPU-only")
    res = bench_train.main(
        "--layers 1 --width 16 --heads 2 --seq-len 32 --window 4 --steps 2 "
        "--vocab 16 --dtype float32 --modes xla,cudnn_window".split()
    )
    assert "CUDA GPU" in res["results"]["cudnn_window"]["error"]
    assert len(res["results"]["xla"]["losses"]) == 2 and "ratio_vs_splat" not in res


# -- examples.gpt_jax: the pure-JAX twin of models.GPT ------------------------------------------------


def _perturbed_flax_gpt(cfg, attention, rng):
    """A Flax GPT whose every parameter (biases and norm scales too) is randomised."""
    model = build(cfg, attention, seed=int(rng.integers(1 << 20)))
    state = nnx.state(model, nnx.Param)
    noisy = jax.tree.map(
        lambda x: jnp.asarray(np.asarray(x) + 0.1 * rng.standard_normal(x.shape, np.float32)), state
    )
    nnx.update(model, noisy)
    return model


@pytest.mark.parametrize(
    "dtype, flax_attention, mode",
    [
        ("float32", "splat", "splat"),
        ("float32", "dense", "xla"),
        ("float32", "dense", "xla_mask"),
        ("bfloat16", "splat", "splat"),
    ],
)
def test_gpt_jax_equals_flax_gpt(dtype, flax_attention, mode, rng):
    cfg = GPTConfig(vocab=32, layers=2, width=32, heads=2, seq_len=64, window=8, dtype=dtype)
    model = _perturbed_flax_gpt(cfg, flax_attention, rng)
    params = gpt_jax.params_from_flax(model)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab, size=(2, cfg.seq_len)), jnp.int32)
    want = np.asarray(model(tokens))
    got = jax.jit(gpt_jax.forward, static_argnums=(2, 3))(params, tokens, cfg, mode)
    assert got.dtype == jnp.float32 and got.shape == want.shape
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(got), want, rtol=tol, atol=tol * np.abs(want).max())


def test_gpt_jax_splat_gradients_match_xla(rng):
    params = gpt_jax.init_params(GPT_CFG, seed=int(rng.integers(1 << 20)))
    batch = tuple(jnp.asarray(x) for x in make_batch(GPT_CFG, rng, 2))
    vg = jax.jit(jax.value_and_grad(gpt_jax.loss_fn), static_argnums=(4, 5))
    ls, gs = vg(params, *batch, GPT_CFG, "splat")
    lx, gx = vg(params, *batch, GPT_CFG, "xla")
    assert float(ls) == pytest.approx(float(lx), rel=1e-5)
    for a, b in zip(jax.tree.leaves(gs), jax.tree.leaves(gx), strict=True):
        assert np.abs(np.asarray(b)).max() > 0
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-5)


def test_gpt_jax_adam_equals_optax(rng):
    import optax

    params = {"a": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), "b": [jnp.asarray(rng.normal(size=5))]}
    opt = optax.adam(3e-3)
    ostate, state = opt.init(params), gpt_jax.adam_init(params)
    want = got = params
    for _ in range(3):
        g = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
        upd, ostate = opt.update(g, ostate, want)
        want = optax.apply_updates(want, upd)
        got, state = gpt_jax.adam_update(got, g, state, 3e-3)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_gpt_jax_trains_and_loss_falls(rng):
    step = gpt_jax.make_train_step(GPT_CFG, "xla", lr=3e-3)  # splat's gradients: the test above
    params = gpt_jax.init_params(GPT_CFG, seed=int(rng.integers(1 << 20)))
    opt_state = gpt_jax.adam_init(params)
    losses = []
    for _ in range(20):
        params, opt_state, loss = step(params, opt_state, *make_batch(GPT_CFG, rng, 4))
        losses.append(float(loss))
    assert np.all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < losses[0] - 0.2, losses


def test_gpt_jax_mode_errors():
    with pytest.raises(ValueError, match="attention must be one of"):
        gpt_jax.make_train_step(GPT_CFG, "dense")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            gpt_jax.make_train_step(GPT_CFG, "cudnn_mask")


def test_gpt_jax_and_bench_import_without_flax_or_optax():
    """The GPU machine's situation: flax and optax cannot be imported."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('flax', 'optax'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import examples.gpt_jax, examples.bench_train, examples.common\n"
        "assert not any(m.split('.')[0] in ('flax', 'optax') for m in sys.modules), 'flax/optax imported'\n"
        "print('ok')\n"
    )
    root = pathlib.Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_config_validation():
    with pytest.raises(ValueError, match="multiple of heads"):
        GPTConfig(width=30, heads=4)
    with pytest.raises(ValueError, match="attention"):
        build(GPT_CFG, "sparse")


# -- gpt_jax: packed documents and decode with a KV cache -----------------------------------------------


# float32 logits of two computations that differ in kernels or shapes (GPUs run float32 matmuls in TF32)
_TOL = 1e-5 if jax.default_backend() == "cpu" else 3e-3


def test_document_ids():
    tokens = jnp.asarray([[0, 5, 6, 0, 7, 8, 9, 0], [5, 5, 5, 5, 5, 0, 0, 6]])
    seg, pos = gpt_jax.document_ids(tokens, eod=0)
    assert seg.tolist() == [[0, 1, 1, 1, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 2]]
    assert pos.tolist() == [[0, 0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 0, 0]]


def test_packed_documents_are_independent(rng):
    """A packed row's logits equal each document's logits run alone (document-causal, positions reset)."""
    cfg = GPT_CFG
    params = gpt_jax.init_params(cfg, seed=int(rng.integers(1 << 20)))
    tokens, _, _ = make_packed_batch(cfg, rng, 2)
    fwd = jax.jit(gpt_jax.forward, static_argnums=(2, 3), static_argnames="eod")
    got = np.asarray(fwd(params, jnp.asarray(tokens), cfg, "splat", eod=0))
    np.testing.assert_allclose(
        np.asarray(fwd(params, jnp.asarray(tokens), cfg, "xla", eod=0)), got, rtol=_TOL, atol=_TOL
    )  # the dense twin with a [B, 1, S, S] document mask
    seg = np.asarray(gpt_jax.document_ids(jnp.asarray(tokens), 0)[0])
    docs = [(b, seg[b] == d) for b in range(2) for d in range(seg[b].max() + 1)]
    assert len(docs) >= 5
    # each document alone at the start of a row of its own (what follows it cannot reach it: causal)
    alone = np.full((len(docs), cfg.seq_len), 1, np.int32)
    for r, (b, cols) in enumerate(docs):
        alone[r, : cols.sum()] = tokens[b, cols]
    alone_logits = np.asarray(fwd(params, jnp.asarray(alone), cfg, "splat"))
    for r, (b, cols) in enumerate(docs):
        np.testing.assert_allclose(alone_logits[r, : cols.sum()], got[b, cols], rtol=_TOL, atol=_TOL)
    unpacked = np.asarray(fwd(params, jnp.asarray(tokens), cfg, "splat"))  # without eod: it differs
    assert np.abs(unpacked - got).max() > 1e-2


def test_gpt_jax_trains_on_packed_documents(rng):
    step = gpt_jax.make_train_step(GPT_CFG, "splat", lr=3e-3, eod=0)
    params = gpt_jax.init_params(GPT_CFG, seed=int(rng.integers(1 << 20)))
    opt_state = gpt_jax.adam_init(params)
    losses = []
    for _ in range(20):
        params, opt_state, loss = step(params, opt_state, *make_packed_batch(GPT_CFG, rng, 4))
        losses.append(float(loss))
    assert np.all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < losses[0] - 0.2, losses
    assert step._cache_size() == 1  # one compile for every packing


def test_decode_with_kv_cache_matches_full_logits(rng):
    """Prompt, then one token a step through the cache (q_offset): the full-sequence logits at every step."""
    cfg = GPT_CFG
    params = gpt_jax.init_params(cfg, seed=int(rng.integers(1 << 20)))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab, size=(2, 24)), jnp.int32)  # > window: the window slides
    fwd = jax.jit(gpt_jax.forward, static_argnums=(2, 3))
    want = np.asarray(fwd(params, tokens, cfg, "splat"))
    run = gpt_jax.extend_jit
    cache = gpt_jax.init_cache(cfg, 2, 24)
    logits, cache = run(params, cache, tokens[:, :5], cfg)  # the prompt
    got = [logits]
    for i in range(5, 24):
        logits, cache = run(params, cache, tokens[:, i : i + 1], cfg)
        got.append(logits)
    np.testing.assert_allclose(np.concatenate(got, axis=1), want, rtol=_TOL, atol=_TOL)
    assert cache["pos"].tolist() == [24, 24]

    out = gpt_jax.generate(params, tokens[:, :5], cfg, steps=19)  # the same shapes: no new compile
    full = np.asarray(fwd(params, out, cfg, "splat"))
    np.testing.assert_array_equal(np.asarray(out[:, 5:]), full[:, 4:-1].argmax(-1))  # greedy, teacher-forced


# -- examples.vit: neighborhood attention on an image's token grid ---------------------------------------

from examples import vit  # noqa: E402

# 16 x 16 images, 2 x 2 patches: an 8 x 8 token grid; blocks of 3 x 3 patches; kernel 3, layer 1 dilated by 2
VIT_CFG = vit.ViTConfig(
    image=16, patch=2, classes=4, block=3, layers=2, width=32, heads=2, kernel=3, dilated_layers=(1,)
)


def test_vit_trains_and_loss_falls():
    res = vit.train(VIT_CFG, steps=100, batch=16, lr=3e-3, quiet=True)
    losses = res["losses"]
    assert np.all(np.isfinite(losses))
    chance = np.log(VIT_CFG.classes)
    assert np.mean(losses[-10:]) < 0.3 * chance, losses  # measured: 1.39 -> 0.04
    assert res["accuracy"] > 0.9 and res["images_per_s"] > 0


def test_vit_task_needs_spatial_attention():
    """The control: kernel 1 (each token attends to itself only) stays at chance."""
    cfg = dataclasses.replace(VIT_CFG, kernel=1)
    losses = vit.train(cfg, steps=100, batch=16, lr=3e-3, quiet=True)["losses"]
    assert np.mean(losses[-10:]) > 0.9 * np.log(cfg.classes), losses  # measured: 1.39 throughout


def test_vit_task_batches(rng):
    images, labels = vit.make_images(VIT_CFG, rng, 8)
    assert images.shape == (8, 16, 16, 3) and images.dtype == np.float32
    assert labels.shape == (8,) and labels.dtype == np.int32 and set(labels) <= set(range(4))
    p = VIT_CFG.patch
    patches = images.reshape(8, 8, p, 8, p, 3).transpose(0, 1, 3, 2, 4, 5)  # [B, G, G, p, p, 3]
    checker = np.add.outer(np.arange(p), np.arange(p)) % 2
    for b in range(8):
        textured = [
            (r, c) for r in range(8) for c in range(8) if np.allclose(patches[b, r, c, :, :, 0], checker)
        ]
        marker = [
            (r, c) for r in range(8) for c in range(8) if np.allclose(patches[b, r, c, :, :, 0], 1 - checker)
        ]
        assert len(textured) == VIT_CFG.classes - 1 and len(marker) == 1
        (r, c), colour = marker[0], vit._palette(VIT_CFG.classes)[labels[b]]
        around = [
            patches[b, r + i, c + j].mean(axis=(0, 1)) for i in (-1, 0, 1) for j in (-1, 0, 1) if i or j
        ]
        np.testing.assert_allclose(around, np.broadcast_to(colour, (8, 3)), atol=0.1)  # its 8 neighbours


@pytest.mark.parametrize("layer", [0, 1], ids=["undilated", "dilated"])
def test_vit_attention_equals_dense_masked_reference(layer, rng):
    """One layer's attention (what forward calls) against float64 dense masked attention."""
    g, h, d = VIT_CFG.grid, VIT_CFG.heads, VIT_CFG.width // VIT_CFG.heads
    q, k, v = (rng.standard_normal((2, g, g, h, d)) for _ in range(3))
    got = np.asarray(vit.attend(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), VIT_CFG, layer, "splat"))
    mask = vit.layer_masks(VIT_CFG)[layer].to_acsr().to_dense()  # [64, 64]
    centre = mask[4 * g + 4].reshape(g, g)  # token (4, 4) sees a 3 x 3 window, keys 1 or 2 apart
    step = VIT_CFG.dilation_of(layer)
    assert step == (1, 2)[layer] and np.nonzero(centre.any(0))[0].tolist() == [4 - step, 4, 4 + step]
    flat = [x.reshape(2, g * g, h, d) for x in (q, k, v)]
    scores = np.einsum("bqhd,bkhd->bhqk", flat[0], flat[1]) / np.sqrt(d)
    scores = np.where(mask, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), flat[2]).reshape(q.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_vit_splat_equals_dense_twin(rng):
    """Logits and gradients of the whole model: splat against the dense-mask twin."""
    params = vit.init_params(VIT_CFG, seed=int(rng.integers(1 << 20)))
    images, labels = (jnp.asarray(x) for x in vit.make_images(VIT_CFG, rng, 4))
    vg = jax.jit(jax.value_and_grad(vit.loss_fn, has_aux=True), static_argnums=(3, 4))
    (ls, _), gs = vg(params, images, labels, VIT_CFG, "splat")
    (ld, _), gd = vg(params, images, labels, VIT_CFG, "dense")
    assert float(ls) == pytest.approx(float(ld), rel=1e-5)
    for a, b in zip(jax.tree.leaves(gs), jax.tree.leaves(gd), strict=True):
        assert np.abs(np.asarray(b)).max() > 0
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-5)


def test_vit_cli_and_config_errors(capsys):
    argv = "--image 32 --patch 4 --classes 1 --block 3 --layers 1 --width 16 --heads 2 --kernel 3"
    out = vit.main([*argv.split(), "--dilated-layers", "0", "--steps", "2", "--batch", "2"])
    assert out["grid"] == [8, 8] and np.isfinite(out["final_loss"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["model"] == "vit"
    with pytest.raises(ValueError, match=r"kernel \* dilation"):
        vit.ViTConfig(image=16, patch=2, block=3, kernel=5, dilation=2)
    with pytest.raises(ValueError, match="classes"):
        vit.ViTConfig(image=16, patch=2, block=3, classes=5)
    with pytest.raises(ValueError, match="block must be odd"):
        vit.ViTConfig(block=4)
    with pytest.raises(ValueError, match="dilated_layers"):
        vit.ViTConfig(layers=2, dilated_layers=(2,))
    with pytest.raises(ValueError, match="attention must be one of"):
        vit.make_train_step(VIT_CFG, "xla")


def test_vit_docstring_example_runs():
    import doctest

    result = doctest.testmod(vit)
    assert result.attempted >= 4 and result.failed == 0
