"""The example models train (loss falls) and splat matches the dense twin."""

import json

import flax.nnx as nnx
import jax
import numpy as np
import pytest

from examples import bench_train
from examples import train as train_mod
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
        "--layers 2 --width 32 --heads 2 --seq-len 64 --window 8 --dtype float32 --steps 4 --vocab 32".split()
    )
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("device", "versions", "splat", "dense", "speedup_dense_over_splat", "loss_max_abs_dev"):
        assert key in printed
    assert len(res["splat"]["losses"]) == 4 and res["loss_max_abs_dev"] < 1e-3


def test_config_validation():
    with pytest.raises(ValueError, match="multiple of heads"):
        GPTConfig(width=30, heads=4)
    with pytest.raises(ValueError, match="attention"):
        build(GPT_CFG, "sparse")
