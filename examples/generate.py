"""Greedy generation end to end: prefill a prompt, then decode through a KV cache with splat.

The GPT of :mod:`examples.gpt_jax` (its blocks, embedding and logits, imported, not copied) with
grouped-query attention: ``--kv-heads`` key/value heads shared by ``--heads`` query heads. Even
layers attend to a causal window of ``--window`` keys (self included), odd layers are global
causal (:func:`examples.common.layer_masks`). Random weights from ``--seed``; bf16 on a GPU,
float32 elsewhere (``--dtype``).

* Prefill: the prompt ``[B, P]`` runs through the model with full-sequence attention
  (:func:`splat.attention` with each layer's mask); each layer's keys and values are written into
  its KV cache (:func:`splat.update_kvcache`): contiguous ``[B, Lmax, Hk, D]``, or with
  ``--paged PAGE_SIZE`` a page pool ``[B * max_pages, PAGE_SIZE, Hk, D]`` and a shuffled page
  table ``int32 [B, max_pages]``. The first token is the argmax of the last position's logits.
* Decode: ``--new-tokens N`` steps of one token each. A step writes the newest token's keys and
  values (:func:`splat.update_kvcache`) and attends with :func:`splat.attention_with_kvcache`
  (each layer its own mask; ``cache_seqlens`` includes the token, whose query sits at the last
  valid position). The ``N`` steps are one jitted call, ``lax.scan`` over the step (faster than a
  Python loop over a jitted step on a CPU; :meth:`Generator._decode_steps` says by how much),
  with the caches donated (updated in place); positions and lengths are traced values carried
  from step to step, so the step is traced and compiled once.

So a run produces ``N + 1`` tokens per row: the prefill's, then one per decode step;
``Lmax = P + N`` (the last token's keys are never needed).

Peers (``--peer``, repeatable), the same model and weights on another attention:

=======  ===================================================================================
dense    ``jax.nn.dot_product_attention`` with dense boolean masks built for each call
         (prefill ``[1, 1, P, P]``, decode ``[B, 1, 1, Lmax]`` from the positions), caches
         written with ``lax.dynamic_update_slice``: no splat code at all. Runs everywhere; the
         reference.
cudnn    ``jax.nn.dot_product_attention(implementation="cudnn")`` (CUDA GPU, 16-bit dtypes).
         Prefill: ``is_causal`` and, on window layers, ``local_window_size=(window - 1, 0)``.
         Decode: ``key_value_seq_lengths`` (no causal flag: the newest token sees every valid
         key); on window layers ``local_window_size`` only where a probe at start-up finds it
         aligned bottom-right (the query at the last valid key), else a dense window mask
         ``[B, 1, 1, Lmax]`` -- the note in the table and the JSON says which.
fa3      ``flash_attn3_jax.flash_mha`` (prefill) and ``flash_mha_with_kvcache`` (decode,
         ``cache_seqlens``, ``window_size=(window - 1, 0)``, ``page_table`` with ``--paged``)
         where importable (a Hopper GPU, 16-bit dtypes).
=======  ===================================================================================

A peer that cannot run here stops the script with the reason before anything runs.

Reports, per run (splat, each peer, and dense with ``--check``): time to first token (prefill +
the first argmax, after a warm-up call compiled it; median of ``--repeats``), decode tokens/s
(``B * N`` / the wall time of the ``N`` steps, synced with the device), the compile times, and
whether the greedy tokens equal the dense run's (``--check``: run both in this process; the
default on a CPU). A table on stdout; ``--out`` writes the same as JSON.

CPU-sized defaults (seconds)::

    python -m examples.generate                      # B=2, prompt 64, 16 new tokens, width 512
    python -m examples.generate --paged 16 --out gen.json

The GPU setting (one H100/H200: B = 8, an 8K prompt, 256 new tokens; head dim 128)::

    python -m examples.generate --batch 8 --prompt 8192 --new-tokens 256 --layers 8 \\
        --width 1024 --heads 8 --kv-heads 2 --window 1024 --peer cudnn --peer fa3 --check \\
        --out generate-h200.json

Example:
  >>> import jax.numpy as jnp
  >>> from examples.common import GPTConfig
  >>> from examples import generate
  >>> cfg = GPTConfig(layers=2, width=64, heads=4, seq_len=24, window=8, vocab=50)   # Lmax = 24
  >>> params = generate.init_params(cfg, kv_heads=2, seed=0)
  >>> gen = generate.Generator(cfg, generate.make_peer("splat", cfg, page_size=8), batch=1)
  >>> gen.generate(params, jnp.zeros((1, 16), jnp.int32), steps=8).shape   # prompt 16, 8 steps
  (1, 9)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

import splat
from examples import gpt_jax
from examples.bench_train import _versions
from examples.common import GPTConfig, layer_masks
from examples.gpt_jax import _block, _embed, _local_mask, _logits, _write
from splat.tools.peers import takes_keyword

__all__ = ["PEERS", "Generator", "Peer", "PeerUnavailable", "init_params", "main", "make_peer"]

PEERS = ("dense", "cudnn", "fa3")


class PeerUnavailable(RuntimeError):
    """A peer cannot run here; the message says why."""


# -----------------------------------------------------------------------------
# parameters
# -----------------------------------------------------------------------------


def init_params(cfg: GPTConfig, kv_heads: int, seed: int = 0) -> dict:
    """:func:`examples.gpt_jax.init_params` with grouped-query K/V projections.

    The ``k`` and ``v`` kernels keep the first ``kv_heads`` of their ``cfg.heads`` heads:
    ``[W, Hk, D]`` and biases ``[Hk, D]``. LeCun-normal draws scale with the fan-in ``W``
    only, so the kept heads are what a ``[W, Hk, D]`` init would draw. Query head ``h``
    reads KV head ``h // (H // Hk)`` (splat and ``jax.nn.dot_product_attention`` agree).
    """
    if not (isinstance(kv_heads, int) and kv_heads >= 1 and cfg.heads % kv_heads == 0):
        raise ValueError(f"kv_heads must be a positive divisor of heads = {cfg.heads}, got {kv_heads!r}")
    params = gpt_jax.init_params(cfg, seed)
    for block in params["blocks"]:
        for name in ("k", "v"):
            block[name] = {
                "kernel": block[name]["kernel"][:, :kv_heads],
                "bias": block[name]["bias"][:kv_heads],
            }
    return params


def _cast(params: dict, dtype) -> dict:
    """Every parameter in the compute dtype, once. The model casts each operand to it before use
    (as nnx does), so this changes no value; it keeps a bf16 decode step from re-reading and
    converting the float32 weights every step."""
    return jax.tree.map(lambda a: a.astype(dtype), params)


# -----------------------------------------------------------------------------
# peers: how one run attends
# -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Peer:
    """One run's attention, per layer ``i`` (even: causal window, odd: global causal).

    Attributes:
      name: "splat" or one of :data:`PEERS`.
      prefill: ``(i, q, k, v) -> out``; ``q, out: [B, P, H, D]``, ``k, v: [B, P, Hk, D]``.
      decode: ``(i, q, k_cache, v_cache, lens, page_table) -> out``; ``q, out: [B, 1, H, D]``,
        ``lens: int32 [B]`` valid keys per row, the new token's included (its query sits at
        position ``lens - 1``).
      write: ``(k_cache, v_cache, k_new, v_new, lens, page_table) -> (k_cache, v_cache)``;
        ``k_new: [B, T, Hk, D]`` go to positions ``lens .. lens + T - 1`` (``lens``: before them).
      page_size: the caches are a page pool ``[num_pages, page_size, Hk, D]`` and a page table;
        None: contiguous ``[B, Lmax, Hk, D]``.
      note: what the run does that the name does not say.
    """

    name: str
    prefill: Callable
    decode: Callable
    write: Callable
    page_size: int | None = None
    note: str = ""


def _splat_write(kc, vc, k, v, lens, page_table):
    return splat.update_kvcache(kc, vc, k, v, lens, page_table=page_table)


def _dense_write(kc, vc, k, v, lens, page_table):
    return _write(kc, k, lens), _write(vc, v, lens)


def _decode_mask(lens: jax.Array, length: int, window: int | None) -> jax.Array:
    """Dense bool ``[B, 1, 1, length]``: the key ``j`` the newest token (at ``lens - 1``) sees."""
    pos = (lens - 1)[:, None]
    j = jnp.arange(length, dtype=jnp.int32)[None, :]
    ok = j <= pos
    if window is not None:
        ok &= pos - j < window
    return ok[:, None, None, :]


def _window_of(cfg: GPTConfig, i: int) -> int | None:
    """Keys layer ``i`` sees (self included): ``cfg.window`` on even layers, None (all) on odd."""
    return cfg.window if i % 2 == 0 else None


def make_peer(name: str, cfg: GPTConfig, *, page_size: int | None = None) -> Peer:
    """The :class:`Peer` ``name`` for model ``cfg``, or :class:`PeerUnavailable` saying why not.

    ``page_size``: splat (and fa3) keep a paged cache; dense and cudnn always a contiguous one.
    """
    if name == "splat":
        masks = layer_masks(cfg)
        return Peer(
            "splat",
            prefill=lambda i, q, k, v: splat.attention(q, k, v, mask=masks[i]),
            decode=lambda i, q, kc, vc, lens, pt: splat.attention_with_kvcache(
                q, kc, vc, masks[i], cache_seqlens=lens, page_table=pt
            ),
            write=_splat_write,
            page_size=page_size,
        )
    if name == "dense":

        def prefill(i, q, k, v):
            p, w = q.shape[1], _window_of(cfg, i)
            return jax.nn.dot_product_attention(q, k, v, mask=_local_mask(p, p if w is None else w))

        def decode(i, q, kc, vc, lens, pt):
            return jax.nn.dot_product_attention(
                q, kc, vc, mask=_decode_mask(lens, kc.shape[1], _window_of(cfg, i))
            )

        return Peer("dense", prefill, decode, _dense_write, note="contiguous cache, dense masks")
    if name == "cudnn":
        return _cudnn_peer(cfg)
    if name == "fa3":
        return _fa3_peer(cfg, page_size)
    raise ValueError(f"peer must be one of {PEERS}, got {name!r}")


def _need_gpu(what: str, cfg: GPTConfig) -> None:
    if jax.default_backend() != "gpu":
        raise PeerUnavailable(
            f"{what} needs a CUDA GPU; the default JAX backend here is {jax.default_backend()!r}"
        )
    if cfg.dtype == "float32":
        raise PeerUnavailable(f"{what} takes float16/bfloat16 only (use --dtype bfloat16)")


def _cudnn_peer(cfg: GPTConfig) -> Peer:
    _need_gpu("cuDNN attention", cfg)
    dpa = lambda *a, **kw: jax.nn.dot_product_attention(*a, implementation="cudnn", **kw)
    heads, d = cfg.heads, cfg.width // cfg.heads
    native, why = _cudnn_window_is_bottom_right(cfg.window, heads, d, jnp.dtype(cfg.dtype))

    def prefill(i, q, k, v):
        w = _window_of(cfg, i)
        return dpa(q, k, v, is_causal=True, local_window_size=None if w is None else (w - 1, 0))

    def decode(i, q, kc, vc, lens, pt):
        w = _window_of(cfg, i)
        if w is None:  # Sq = 1 and no causal flag: the newest token sees every valid key
            return dpa(q, kc, vc, key_value_seq_lengths=lens)
        if native:
            return dpa(q, kc, vc, key_value_seq_lengths=lens, local_window_size=(w - 1, 0))
        return dpa(q, kc, vc, mask=_decode_mask(lens, kc.shape[1], w), key_value_seq_lengths=lens)

    how = "local_window_size" if native else "a dense window mask"
    return Peer("cudnn", prefill, decode, _dense_write, note=f"decode window layers: {how} ({why})")


def _cudnn_window_is_bottom_right(window: int, heads: int, d: int, dtype) -> tuple[bool, str]:
    """Whether cuDNN's decode window (``Sq = 1``, ``key_value_seq_lengths``, ``local_window_size``)
    puts the query at the last valid key, as decode needs. jax's XLA twin places query ``i`` at
    key ``i`` (top-left: query 0 sees key 0 only); cuDNN's alignment is read off one small call
    against the dense mask rather than assumed, so a jax that aligns it right gets the native
    window."""
    length, valid = 4 * window + 8, 3 * window + 5  # the window ends well inside the valid keys
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (1, 1, heads, d), dtype)
    k, v = (jax.random.normal(x, (1, length, 1, d), dtype) for x in (kk, kv))
    lens = jnp.array([valid], jnp.int32)
    try:
        got = jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=lens, local_window_size=(window - 1, 0), implementation="cudnn"
        )
    except Exception as e:  # any refusal means: use the mask
        return False, f"cuDNN refused local_window_size at Sq = 1: {type(e).__name__}"
    f32 = lambda x: x.astype(jnp.float32)
    want = jax.nn.dot_product_attention(f32(q), f32(k), f32(v), mask=_decode_mask(lens, length, window))
    err = float(jnp.max(jnp.abs(f32(got) - want)))
    if err < 2e-2:
        return True, f"probe: aligned bottom-right, max err {err:.1e}"
    return False, f"probe: cuDNN's window is not aligned bottom-right at Sq = 1 (max err {err:.2f})"


def _fa3_peer(cfg: GPTConfig, page_size: int | None) -> Peer:
    try:
        fa3 = importlib.import_module("flash_attn3_jax")
    except ImportError as e:
        raise PeerUnavailable(f"flash_attn3_jax is not installed ({e})") from None
    _need_gpu("FlashAttention-3", cfg)
    with_cache = getattr(fa3, "flash_mha_with_kvcache", None)
    if with_cache is None or not takes_keyword(with_cache, "cache_seqlens"):
        raise PeerUnavailable("this flash_attn3_jax has no flash_mha_with_kvcache(..., cache_seqlens=)")
    if page_size is not None and not takes_keyword(with_cache, "page_table"):
        raise PeerUnavailable("this flash_mha_with_kvcache takes no page_table (run without --paged)")
    scale = (cfg.width // cfg.heads) ** -0.5

    def window(i):
        w = _window_of(cfg, i)
        return (-1, -1) if w is None else (w - 1, 0)

    def prefill(i, q, k, v):
        return fa3.flash_mha(q, k, v, softmax_scale=scale, is_causal=True, window_size=window(i))

    def decode(i, q, kc, vc, lens, pt):
        kw = {} if pt is None else {"page_table": pt}
        return with_cache(
            q, kc, vc, cache_seqlens=lens, softmax_scale=scale, is_causal=True, window_size=window(i), **kw
        )

    return Peer("fa3", prefill, decode, _splat_write, page_size, note="flash_mha, flash_mha_with_kvcache")


# -----------------------------------------------------------------------------
# the generator: prefill and decode, one jitted function each
# -----------------------------------------------------------------------------


class Generator:
    """Prefill and decode of ``cfg``'s model on one :class:`Peer`, for ``batch`` rows of up to
    ``cfg.seq_len`` tokens (``Lmax``).

    A paged peer's pool holds ``batch * max_pages`` pages, ``max_pages = ceil(Lmax / page_size)``,
    and ``page_table`` (int32 ``[batch, max_pages]``) gives each row a shuffled set of them
    (``seed``), as a pool looks after many requests came and went; contiguous: ``page_table`` None.

    :meth:`prefill` and :meth:`decode` are one jitted function each, :meth:`decode` taking the
    caches donated. ``traces`` counts how often the prefill and the decode step were traced (a
    Python side effect in the traced functions): once each for any prompt and token values, and
    once per number of steps.
    """

    def __init__(self, cfg: GPTConfig, peer: Peer, batch: int, *, seed: int = 0):
        self.cfg, self.peer, self.batch = cfg, peer, batch
        self.dtype = jnp.dtype(cfg.dtype)
        self.traces = {"prefill": 0, "step": 0}
        self.page_table = None
        if peer.page_size is not None:
            self.max_pages = -(-cfg.seq_len // peer.page_size)
            perm = np.random.default_rng(seed).permutation(batch * self.max_pages)
            self.page_table = jnp.asarray(perm.reshape(batch, self.max_pages), jnp.int32)
        self.prefill = jax.jit(self._prefill)
        self._decode = jax.jit(self._decode_steps, static_argnames="steps", donate_argnums=1)

    def _empty_cache(self, kv_heads: int, d: int):
        if self.peer.page_size is not None:
            shape = (self.batch * self.max_pages, self.peer.page_size, kv_heads, d)
        else:
            shape = (self.batch, self.cfg.seq_len, kv_heads, d)
        return jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype)

    def _prefill(self, params, tokens, page_table):
        """``tokens int32 [B, P]`` -> ``(first token int32 [B], caches: [(k, v)] per layer)``."""
        self.traces["prefill"] += 1
        b, p = tokens.shape
        emb, x = _embed(params, tokens, jnp.arange(p), self.dtype)
        start = jnp.zeros((b,), jnp.int32)
        caches = []
        for i, blk in enumerate(params["blocks"]):

            def attend(q, k, v, i=i):
                kc, vc = self._empty_cache(k.shape[2], k.shape[3])
                caches.append(self.peer.write(kc, vc, k, v, start, page_table))
                return self.peer.prefill(i, q, k, v)

            x = _block(x, blk, attend, self.dtype)
        logits = _logits(params, x[:, -1:], emb, self.dtype)[:, 0]
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), caches

    def _step(self, params, caches, tokens, lens, page_table):
        """One decode step: ``tokens int32 [B]`` at positions ``lens int32 [B]`` (the tokens cached
        before them) -> ``(next tokens [B], caches, lens + 1)``. Traced once, as the body of
        :meth:`decode`'s scan; positions and lengths are traced values."""
        self.traces["step"] += 1
        emb, x = _embed(params, tokens[:, None], lens[:, None], self.dtype)
        new = []
        for i, (blk, (kc, vc)) in enumerate(zip(params["blocks"], caches, strict=True)):

            def attend(q, k, v, i=i, kc=kc, vc=vc):
                kc, vc = self.peer.write(kc, vc, k, v, lens, page_table)
                new.append((kc, vc))
                return self.peer.decode(i, q, kc, vc, lens + 1, page_table)

            x = _block(x, blk, attend, self.dtype)
        logits = _logits(params, x, emb, self.dtype)[:, 0]
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), new, lens + 1

    def decode(self, params, caches, first, prompt_len: int, steps: int):
        """``steps`` decode steps after the prefill's ``first`` token: ``tokens int32 [B, steps]``.

        ``caches`` hold the ``prompt_len`` prompt tokens of every row; they are donated (do not
        use them afterwards). ``prompt_len + steps <= cfg.seq_len``. Returns ``(tokens, caches)``.
        """
        if prompt_len + steps > self.cfg.seq_len:
            raise ValueError(f"prompt_len + steps must be <= cfg.seq_len = {self.cfg.seq_len}")
        lens = jnp.full((self.batch,), prompt_len, jnp.int32)
        return self._decode(params, caches, first, lens, self.page_table, steps=steps)

    def _decode_steps(self, params, caches, token, lens, page_table, *, steps: int):
        # The steps run under lax.scan, inside the one jitted call, rather than as a Python loop
        # over a jitted step. Measured on a 2-core CPU (B = 2, prompt 64, 16 and 64 steps): as
        # fast at width 512 (2.4 ms a step either way: the weights' reads dominate) and 1.6-1.8x
        # faster at width 128 (0.13 against 0.21 ms for splat, 0.05 against 0.09 for dense), where
        # the loop's dispatch of a call with every parameter and cache as an argument is most of a
        # step. The price: one compile per number of steps, where the loop's step compiles once
        # for any number. Not measured on a GPU, where the loop's dispatch would have to stay under
        # a step's time to keep up.
        def body(carry, _):
            token, caches, lens = carry
            token, caches, lens = self._step(params, caches, token, lens, page_table)
            return (token, caches, lens), token

        (_, caches, _), tokens = jax.lax.scan(body, (token, caches, lens), None, length=steps)
        return tokens.T, caches

    def generate(self, params, prompt, steps: int) -> jax.Array:
        """``prompt int32 [B, P]`` -> the ``steps + 1`` greedy tokens after it, ``int32 [B, steps + 1]``."""
        first, caches = self.prefill(params, prompt, self.page_table)
        rest, _ = self.decode(params, caches, first, prompt.shape[1], steps)
        return jnp.concatenate([first[:, None], rest], axis=1)


# -----------------------------------------------------------------------------
# timing and the command line
# -----------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def measure(gen: Generator, params, prompt, steps: int, repeats: int) -> dict:
    """Generates ``steps + 1`` tokens after ``prompt`` ``repeats`` times; times and tokens.

    A first call of each jitted function compiles it (``*_first_call_s``: compile + run); then
    each repeat times the prefill with the first argmax (``ttft``) and the ``steps`` decode steps,
    each synced with the device (``jax.block_until_ready``). Medians over the repeats.
    """
    b, p = prompt.shape
    t0 = time.perf_counter()
    first, caches = jax.block_until_ready(gen.prefill(params, prompt, gen.page_table))
    t1 = time.perf_counter()
    jax.block_until_ready(gen.decode(params, caches, first, p, steps))
    t2 = time.perf_counter()
    ttft, dec = [], []
    for _ in range(repeats):
        s0 = time.perf_counter()
        first, caches = jax.block_until_ready(gen.prefill(params, prompt, gen.page_table))
        s1 = time.perf_counter()
        rest, _ = jax.block_until_ready(gen.decode(params, caches, first, p, steps))
        s2 = time.perf_counter()
        ttft.append(s1 - s0)
        dec.append(s2 - s1)
    decode_s = float(np.median(dec))
    return {
        "cache": "contiguous" if gen.peer.page_size is None else f"paged({gen.peer.page_size})",
        "note": gen.peer.note,
        "ttft_ms": 1e3 * float(np.median(ttft)),
        "ttft_ms_min": 1e3 * float(np.min(ttft)),
        "decode_s": decode_s,
        "decode_tokens_per_s": b * steps / decode_s,
        "step_ms": 1e3 * decode_s / steps,
        "prefill_first_call_s": t1 - t0,
        "decode_first_call_s": t2 - t1,
        "traces": dict(gen.traces),
        "tokens": np.concatenate([np.asarray(first)[:, None], np.asarray(rest)], axis=1),
    }


def _compare(tokens: np.ndarray, ref: np.ndarray) -> dict:
    """Whether two runs' greedy tokens ``[B, N + 1]`` agree, and where they first part."""
    same = tokens == ref
    out = {"tokens_match": bool(same.all()), "match_fraction": float(same.mean()), "first_mismatch": None}
    if not same.all():
        where = np.argwhere(~same)  # [row, index] pairs
        row, idx = (int(x) for x in where[np.argmin(where[:, 1])])
        out["first_mismatch"] = {"row": row, "index": idx}
    return out


def _table(runs: dict) -> str:
    head = ("run", "cache", "TTFT ms", "decode tok/s", "ms/step", "compile s", "= dense")
    rows = [head]
    for name, r in runs.items():
        same = "(ref)" if name == "dense" else {True: "yes", False: "NO", None: "-"}[r.get("tokens_match")]
        compile_s = f"{r['prefill_first_call_s']:.1f} + {r['decode_first_call_s']:.1f}"
        rows.append(
            (
                name,
                r["cache"],
                f"{r['ttft_ms']:.2f}",
                f"{r['decode_tokens_per_s']:.1f}",
                f"{r['step_ms']:.3f}",
                compile_s,
                same,
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(head))]
    lines = ["  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    notes = [f"  {name}: {r['note']}" for name, r in runs.items() if r["note"]]
    return "\n".join(lines + notes)


def main(argv: list[str] | None = None) -> dict:
    """Command line; returns what ``--out`` writes (token arrays as lists)."""
    on_gpu = jax.default_backend() == "gpu"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per row")
    ap.add_argument("--new-tokens", type=int, default=16, help="decode steps (N + 1 tokens come out)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--window", type=int, default=32, help="keys a window layer sees, itself included")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="default: bf16 on GPU"
    )
    ap.add_argument(
        "--paged", type=int, default=None, metavar="PAGE_SIZE", help="splat (and fa3): a paged cache"
    )
    ap.add_argument("--peer", action="append", choices=PEERS, default=[], help="repeatable")
    ap.add_argument("--check", action=argparse.BooleanOptionalAction, default=None, help="default: on a CPU")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    for name in ("batch", "prompt", "new_tokens", "repeats"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.paged is not None and a.paged < 1:
        ap.error("--paged PAGE_SIZE must be >= 1")
    if a.kv_heads < 1 or a.heads % a.kv_heads:
        ap.error(f"--kv-heads must divide --heads ({a.heads})")
    dtype = a.dtype or ("bfloat16" if on_gpu else "float32")
    check = (not on_gpu) if a.check is None else a.check
    cfg = GPTConfig(
        vocab=a.vocab,
        layers=a.layers,
        width=a.width,
        heads=a.heads,
        seq_len=a.prompt + a.new_tokens,
        window=a.window,
        dtype=dtype,
    )
    names = ["splat", *dict.fromkeys(a.peer)]
    if check and "dense" not in names:
        names.append("dense")
    peers = {}
    for name in names:  # every peer is resolved before anything runs
        try:
            peers[name] = make_peer(name, cfg, page_size=a.paged)
        except PeerUnavailable as e:
            sys.exit(f"generate: --peer {name} cannot run here: {e}")

    params = _cast(init_params(cfg, a.kv_heads, a.seed), cfg.dtype)
    prompt = jnp.asarray(np.random.default_rng(a.seed).integers(0, a.vocab, (a.batch, a.prompt)), jnp.int32)
    runs = {}
    for name, peer in peers.items():
        _log(f"[{name}] prefill {a.batch} x {a.prompt}, then {a.new_tokens} decode steps")
        gen = Generator(cfg, peer, a.batch, seed=a.seed)
        runs[name] = measure(gen, params, prompt, a.new_tokens, a.repeats)
    checked = "dense" in runs  # --check, or dense as a peer
    for name, r in runs.items():
        if checked and name != "dense":
            r.update(_compare(r["tokens"], runs["dense"]["tokens"]))
            if not r["tokens_match"]:  # in 16-bit dtypes a near tie can part them legitimately
                _log(f"[{name}] greedy tokens differ from the dense run's from {r['first_mismatch']} on")
    dev = jax.devices()[0]
    result = {
        "example": "examples.generate",
        "device": getattr(dev, "device_kind", str(dev)),
        "platform": jax.default_backend(),
        "versions": _versions(),
        "config": {
            **dataclasses.asdict(cfg),
            "kv_heads": a.kv_heads,
            "head_dim": a.width // a.heads,
            "batch": a.batch,
            "prompt": a.prompt,
            "new_tokens": a.new_tokens,
            "paged": a.paged,
            "repeats": a.repeats,
            "seed": a.seed,
        },
        "checked": checked,
        "tokens_match": all(r["tokens_match"] for n, r in runs.items() if n != "dense") if checked else None,
        "runs": {n: {**r, "tokens": r["tokens"].tolist()} for n, r in runs.items()},
    }
    print(_table(runs))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        _log(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
