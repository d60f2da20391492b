"""Sequence-parallel attention (``splat.attention(sequence_axis=)``, ``splat.sharded_attention``).

Exactness runs in subprocesses with 2, 4 and (``--runslow``) 8 CPU devices
(``--xla_force_host_platform_device_count`` must be set before JAX starts; this process has one
device): every case of ``tests/sequence_parallel_cases.py`` -- windows, a window longer than a
shard, causal balanced by the zigzag order, packed documents (contiguous and zigzag), global tokens
+ window, prefix-LM, 2-D neighborhoods sharded on rows, one KV head (MQA), a 2-D mesh with the batch
on another axis; shards of 30 and 48 tokens (no tile multiple); GQA, soft cap, query and key lengths
-- forward and gradients against the float64 reference and one device. Here, in this process: the
plans (which keys move, how many ring steps), the zigzag helpers, the one-device mesh, and every
refusal.
"""

from __future__ import annotations

import doctest
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import splat
from splat import _sharded, masks
from splat._sharded import _api, _order, _plan
from tests.sequence_parallel_cases import CASES

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "sequence_parallel_cases.py"


@functools.cache
def _worker(devices: int) -> dict:
    """Every case for ``devices`` devices, run once in one subprocess."""
    names = [n for n, c in CASES.items() if c.devices == devices] + (["bad_length"] if devices == 2 else [])
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["JAX_PLATFORMS"] = "cpu"
    p = subprocess.run(
        [sys.executable, str(WORKER), "--devices", str(devices), *names],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


# 8 devices: the same plans as 4 at more shards, a subprocess of ~40 s on 2 cores (--runslow)
_SLOW_DEVICES = 8


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if c.devices >= _SLOW_DEVICES else n for n, c in CASES.items()],
)
def test_sharded_equals_one_device(name):
    r = _worker(CASES[name].devices)[name]
    assert r["error"] is None, r["error"]
    assert r["ok"], json.dumps(r["errors"], indent=1) + "\n" + r["plan"]


def test_packed_documents_stop_the_ring_at_run_time():
    # documents of at most 30 tokens over shards of 40 reach 1 shard back of 3
    assert _worker(4)["docs_4"]["errors"]["ring_reach"] == 1
    # lengths and documents, zigzag: every device holds valid tokens of long documents: the whole ring
    assert _worker(4)["docs_zigzag"]["errors"]["ring_reach"] == 3


@pytest.mark.slow
def test_packed_documents_stop_the_ring_on_eight_devices():
    # documents of at most 30 tokens over shards of 16 reach at most 2 shards back of 7
    assert 1 <= _worker(8)["docs_8"]["errors"]["ring_reach"] <= 2


def test_a_sequence_the_axis_does_not_divide_is_refused_naming_query():
    msg = _worker(2)["bad_length"]
    assert "query has sequence length 9" in msg and "multiple of 2" in msg and "'sp'" in msg


# --- plans ---------------------------------------------------------------------------------------


def test_a_causal_window_fetches_exactly_its_keys_from_one_neighbour():
    p = _plan.plan(masks.sliding_window(19, 0).to_acsr(256), 4)
    assert p.mode == "halo" and [s.offset for s in p.steps] == [0, -1]
    assert p.steps[1].cols == (64 - 19, 64) and p.halo_keys == 19
    assert p.steps[1].index == (-1, 0, 0, 0) or p.steps[1].index[0] == -1  # device 0 has no left neighbour


def test_a_window_longer_than_a_shard_spans_two_neighbours():
    p = _plan.plan(masks.sliding_window(44, 0).to_acsr(120), 4)  # shards of 30
    assert p.mode == "halo" and p.halo_keys == 44
    assert [(s.offset, s.cols) for s in p.steps[1:]] == [(-1, (0, 30)), (-2, (16, 30))]
    assert p.steps[2].index[:2] == (-1, -1)


def test_bidirectional_windows_and_neighborhoods_fetch_both_sides():
    p = _plan.plan(masks.sliding_window(10, 3).to_acsr(128), 8)
    assert [(s.offset, s.width) for s in p.steps] == [(0, 16), (-1, 10), (1, 3)]
    nb = _plan.plan(masks.neighborhood((16, 8), 5).to_acsr(), 2)  # rows 0-7 | 8-15, 2 rows of halo each way
    assert nb.mode == "halo" and [(s.offset, s.width) for s in nb.steps[1:]] == [(-1, 16), (1, 16)]


def test_block_local_on_shard_boundaries_moves_nothing():
    p = _plan.plan(masks.block_local(32, 0).to_acsr(128), 4)
    assert p.mode == "local" and len(p.steps) == 1 and p.blocks[0].full  # own 32-key block, whole


def test_causal_rings_and_the_zigzag_order_balances_it():
    contiguous = _plan.plan(masks.causal().to_acsr(256), 4)
    assert contiguous.mode == "ring" and len(contiguous.steps) == 4
    work = lambda p, s: [0 if i < 0 else p.blocks[i].nnz for i in s.index]
    assert work(contiguous, contiguous.steps[1]) == [0, 64 * 64, 64 * 64, 64 * 64]  # device 0 idles
    zz = _plan.plan(masks.causal().to_acsr(256), 4, "zigzag")
    for s in zz.steps[1:]:
        assert work(zz, s) == [32 * 64] * 4  # every device half a block, every step
    assert len({zz.blocks[i].layout.nnz for i in zz.steps[0].index}) == 1


def test_a_ring_stops_after_its_last_step_with_work_and_runs_the_short_way():
    n = 32  # 8 shards of 32; a causal window of 2.5 shards reads 3 shards back
    back = _plan.plan(masks.sliding_window(80, 0).to_acsr(8 * n), 8)
    assert back.mode == "ring" and back.direction == 1 and len(back.steps) == 4
    ahead = _plan.plan(masks.sliding_window(0, 80).to_acsr(8 * n), 8)
    assert ahead.mode == "ring" and ahead.direction == -1 and len(ahead.steps) == 4


def test_plan_blocks_tile_the_mask_exactly():
    layout = (masks.global_tokens(3) | masks.dilated_window(9, 2)).to_acsr(96)
    for order in ("contiguous", "zigzag"):
        p = _plan.plan(layout, 4, order)
        pos = _order.positions(order, 24, 4)
        got = np.zeros((96, 96), bool)
        for step in p.steps:
            for i, b in enumerate(step.index):
                if b < 0:
                    continue
                blk = p.blocks[b]
                j = p.key_device(step, i)
                rows = pos[i][blk.rows[0] : blk.rows[1]]
                cols = pos[j][step.cols[0] + blk.cols[0] : step.cols[0] + blk.cols[1]]
                got[np.ix_(rows, cols)] |= blk.layout.to_dense()
        np.testing.assert_array_equal(got, layout.to_dense())


# --- the zigzag order ------------------------------------------------------------------------------


def test_zigzag_helpers_invert_each_other_and_give_positions():
    x = np.arange(2 * 24).reshape(2, 24)
    z = splat.zigzag(x, 3)
    assert z[0].tolist() == [
        0,
        1,
        2,
        3,
        20,
        21,
        22,
        23,
        4,
        5,
        6,
        7,
        16,
        17,
        18,
        19,
        8,
        9,
        10,
        11,
        12,
        13,
        14,
        15,
    ]
    np.testing.assert_array_equal(splat.unzigzag(z, 3), x)
    np.testing.assert_array_equal(splat.zigzag_positions(24, 3), z[0])
    np.testing.assert_array_equal(splat.unzigzag(splat.zigzag(jnp.asarray(x), 3), 3), x)
    with pytest.raises(ValueError, match="multiple of 6"):
        splat.zigzag(x[:, :20], 3)


# --- one device, and refusals ------------------------------------------------------------------------


def _qkv(s=32, h=2, d=8):
    return jax.random.normal(jax.random.key(0), (3, 1, s, h, d))


def test_one_device_mesh_equals_attention():
    q, k, v = _qkv()
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("sp",))
    m = masks.sliding_window(5, 0)
    out = splat.sharded_attention(q, k, v, m, mesh=mesh, axis="sp", order="zigzag")
    np.testing.assert_allclose(out, splat.attention(q, k, v, m), atol=1e-6)


def test_an_unbound_axis_is_refused_naming_sequence_axis():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="sequence_axis='sp' is not a bound mesh axis"):
        splat.attention(q, k, v, masks.causal(), sequence_axis="sp")
    with pytest.raises(TypeError, match="sequence_axis must be a mesh axis name"):
        splat.attention(q, k, v, masks.causal(), sequence_axis=3)
    with pytest.raises(ValueError, match="order must be one of"):
        splat.SequenceAxis("sp", order="striped")


def _in_shard_map(fn, check_vma=False):
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("sp",))
    return jax.shard_map(fn, mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"), check_vma=check_vma)


def test_what_cannot_be_sharded_is_refused_naming_the_argument():
    q, k, v = _qkv()
    call = lambda **kw: _in_shard_map(lambda q, k, v: splat.attention(q, k, v, sequence_axis="sp", **kw))(
        q, k, v
    )
    with pytest.raises(ValueError, match="q_offset cannot be combined with sequence_axis"):
        call(mask=masks.causal(), q_offset=0)
    with pytest.raises(ValueError, match="q_positions and kv_positions cannot be combined"):
        call(mask=masks.causal(), q_positions=jnp.zeros((1, 32), jnp.int32))
    with pytest.raises(ValueError, match="mask layout is 16 x 16, but with sequence_axis"):
        call(mask=masks.causal().to_acsr(16))
    with pytest.raises(ValueError, match="mask array must have shape") as e:
        call(mask=np.ones((16, 16), bool))
    assert "describes the whole sequence" in str(e.value.__notes__)
    with pytest.raises(ValueError, match="query has 31 tokens a device, but the zigzag order"):
        seq = splat.SequenceAxis("sp", "zigzag")
        _in_shard_map(lambda q: splat.attention(q, q, q, sequence_axis=seq))(q[:, :31])
    typed = _in_shard_map(lambda q, k, v: splat.attention(q, k, v, sequence_axis="sp"), check_vma=True)
    with pytest.raises(ValueError, match=r"check_vma=False"):
        typed(q, k, v)


def test_sharded_attention_refuses_an_axis_the_mesh_lacks():
    q, k, v = _qkv()
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("sp",))
    with pytest.raises(ValueError, match="axis must name an axis of mesh"):
        splat.sharded_attention(q, k, v, mesh=mesh, axis="seq")


def test_docstring_examples_run():
    for mod in (_order, _plan, _api, _sharded._blocks):
        result = doctest.testmod(mod)
        assert result.failed == 0, mod.__name__
    from jax_bindings import _blockwise

    assert doctest.testmod(_blockwise).failed == 0


# --- the benchmark's smoke mode ------------------------------------------------------------------


def test_benchmark_smoke_mode_runs_on_cpu_devices(tmp_path):
    import importlib.util

    out, png = tmp_path / "sp.json", tmp_path / "sp.png"
    argv = ["--smoke", "--devices", "2", "--cases", "window_131k", "--modes", "fwd_bwd", "--out", str(out)]
    argv += ["--plot", str(png)] if importlib.util.find_spec("matplotlib") else []
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_sequence_parallel.py"), *argv],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    result = json.loads(out.read_text())
    assert (
        result["schema"] == "splat-bench-sequence-parallel/1" and result["environment"]["device_count"] == 2
    )
    rows = {(r["mode"], r["label"]): r for r in result["results"]}
    assert set(rows) == {("fwd_bwd", x) for x in ("one_device", "sharded[2]", "allgather[2]")}
    for (_, label), r in rows.items():
        assert r["ms"] > 0 and r["speedup"] > 0 and "program_bytes" in r
        if label != "one_device":
            assert r["agrees"] is True, r
    assert rows[("fwd_bwd", "sharded[2]")]["plan"].startswith("halo over 2 devices")
    assert [t["case"] for t in result["targets"]] == ["window_131k", "window_131k"]
    assert not png.exists() or png.stat().st_size > 0
