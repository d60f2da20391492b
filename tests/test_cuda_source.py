"""The CUDA C++ generator and compiler (``jax_bindings._cuda.source``, ``jax_bindings._cuda.compiler``).

Bad arguments are refused by name; the band and tile are baked into each variant's generated header
of constants; and, where a CUDA compiler is found (NVRTC from the test extra's ``nvidia-cuda-nvrtc``
wheel, or nvcc), every variant the backend and the spike generate compiles for sm_90a with no
warnings and at most a few bytes spilled, within the 168 registers a thread that ``setmaxnreg``
redistributes (the kernel would hang if the consumers asked for more than exists). The kernels'
numerics are checked on a GPU (``test_cuda_gpu.py``); there is no CPU interpreter for CUDA C++.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from jax_bindings._cuda import bwd_passes, compiler, grid_tiles, plan
from jax_bindings._cuda import bwd_source as bwd
from jax_bindings._cuda import source as gen
from splat import masks


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(block_n=100), "block_n"),
        (dict(block_n=272), "block_n"),
        (dict(stages=0), "stages"),
        (dict(dtype="float32"), "dtype"),
        (dict(schedule="grid"), "schedule"),  # one CTA per row block: no longer generated
        (dict(schedule="dynamic"), "schedule"),
        (dict(schedule="queue", section_bytes=-1), "section_bytes"),
        (dict(schedule="queue", section_bytes=1.5), "section_bytes"),
        (dict(schedule="queue", section_bytes=True), "section_bytes"),
        (dict(runtime="padding"), "runtime"),
        (dict(schedule="queue", o_store="smem"), "o_store"),
        (dict(band_block=0), "band_block"),
        (dict(band_block=2.0), "band_block"),
        (dict(band_block=True), "band_block"),
    ],
)
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        gen.source(None, None, **kwargs)


@pytest.mark.parametrize("left, right, name", [(1.5, 0, "left"), (None, 2**30, "right"), (True, 0, "left")])
def test_bad_bounds_are_named(left, right, name):
    with pytest.raises(ValueError, match=name):
        gen.source(left, right)


def _config(prog) -> str:
    """The generated header of constants of a forward or backward program."""
    return next(t for n, t in prog.headers if n in ("fwd_config.cuh", "bwd_config.cuh"))


def test_mask_bounds_tile_and_dtype_are_baked_in():
    """The band, the tile and the element type are constants of the generated header; its wgmma
    instructions are those of the tile width and element type; nothing is left to substitute."""
    config = _config(gen.program(1023, 0, block_n=176, stages=3))
    assert "constexpr int LEFT = 1023;" in config and "constexpr int RIGHT = 0;" in config
    assert "constexpr int BN = 176;" in config and "constexpr int STAGES = 3;" in config
    assert "wgmma_ss<Bf16, 176>" in config and "m64n176k16.f32.bf16.bf16" in config
    assert "using Elem = Bf16;" in config
    dense = _config(gen.program(None, None, dtype="float16"))
    unbounded = gen.bound(None)
    assert f"constexpr int LEFT = {unbounded};" in dense and f"constexpr int RIGHT = {unbounded};" in dense
    assert "m64n128k16.f32.f16.f16" in dense and "using Elem = Fp16;" in dense and "bf16" not in dense
    assert "constexpr int LEFT = -5;" in _config(gen.program(-5, -3))  # a band off the diagonal
    src = gen.source(1023, 0, block_n=176, stages=3)
    placeholders = set(re.findall(r"__[A-Z][A-Z_]*__", src)) - {"__CUDACC_RTC__"}
    assert not placeholders, f"template placeholders left unfilled: {placeholders}"
    assert '#include "' not in src  # one text that compiles alone


def test_every_variant_gets_its_own_kernel_name():
    """jaxlib keys loaded cubin kernels by name and shared memory: variants must differ by name."""
    args = [((None, 0), {}), ((255, 0), {}), ((255, 0), {"dtype": "float16"}), ((None, 0), {})]
    progs = [gen.program(*a, **kw) for a, kw in args]
    assert len({p.name for p in progs[:3]}) == 3 and progs[0].name == progs[3].name
    assert all(p.name.startswith("splat_fwd_") for p in progs)
    texts = [gen.source(*a, **kw) for a, kw in args]
    named = [gen.with_unique_name(t) for t in texts]
    assert len({n for n, _ in named[:3]}) == 3 and named[0] == named[3]
    for name, text in named:
        assert f"#define SPLAT_KERNEL_NAME {name}\n" in text and gen.KERNEL_NAME not in text
        assert "__launch_bounds__(THREADS, 1) SPLAT_KERNEL_NAME(" in text
        assert "constexpr int THREADS = 384;" in text


def test_shared_memory_fits_the_variants_built():
    """Every schedule has the same layout: the ring's mbarriers, two Q slots' and the queue's two
    ticket slots' mbarriers and the tickets fit in 256 bytes with 2 or 3 stages; a second Q tile
    (32 KiB) fits beside two stages of 128-key tiles, not of 176."""
    limit = gen.SMEM_LIMIT
    assert limit == 232448  # bytes a block may opt into on sm_90
    assert gen.smem_bytes(2, 176) == 214656 and gen.smem_bytes(2, 128) == 165504
    assert gen.smem_bytes(3, 128) == 231040 <= limit
    assert gen.smem_bytes(3, 176) > limit  # the spike skips it
    assert gen.smem_bytes(2, 128, q_stages=2) == 165504 + 32768 <= limit
    assert gen.smem_bytes(2, 176, q_stages=2) > limit
    # out's tensor map: one more staging buffer; its rows are staged in the Q tile
    assert gen.smem_bytes(2, 128, q_stages=2, o_store="tma") == 165504 + 32768 + 128
    assert gen.smem_bytes(2, 128, "ids", 2, "tma") <= limit
    for stages in (2, 3):  # the kernel lays out what is counted
        assert "BAR_BYTES = 256;" in gen.source(None, None, stages=stages)


def test_out_is_stored_by_tma_only_from_a_band_kernel():
    """``o_store="tma"`` bakes in the staged epilogue (out's map fourth in the templates, each
    CTA's slot holding four maps); grid tiles refuse it."""
    assert "O_TMA = true;" in gen.source(255, 255, schedule="strided", o_store="tma")
    assert "O_TMA = false;" in gen.source(255, 255, schedule="strided")
    assert gen.SLOT_BYTES == 4 * 128
    tiles = grid_tiles.grid_plan(masks.neighborhood((16, 20), 5).to_acsr().grid).tiles
    with pytest.raises(ValueError, match="o_store"):
        gen.source(None, None, grid=tiles, block_n=tiles.block_n, o_store="tma")


def test_rescheduled_variants_keep_what_their_schedule_takes():
    """``plan.rescheduled``: another schedule keeps the variant's Q tiles and store unless told,
    two Q tiles only where they fit."""

    window = plan.fwd_variant(masks.sliding_window(255, 255).to_acsr(4096), 128, "bfloat16")
    queue = plan.rescheduled(window, "queue", 3 << 20)
    got = (queue.schedule, queue.section_bytes, queue.q_stages, queue.o_store)
    assert got == ("queue", 3 << 20, 2, "tma")
    one = plan.rescheduled(window, "strided", q_stages=1, o_store="registers")
    assert (one.q_stages, one.o_store) == (1, "registers")
    dense = plan.fwd_variant(masks.full().to_acsr(4096), 128, "bfloat16")
    assert plan.rescheduled(dense, "strided", q_stages=2).q_stages == 1  # no room beside 176-key tiles


def test_one_or_two_q_tiles():
    """``q_stages`` is baked in; a count other than 1 or 2 is refused by name."""
    assert "Q_STAGES = 2;" in gen.source(255, 255, schedule="strided", q_stages=2)
    assert "Q_STAGES = 1;" in gen.source(255, 255, schedule="strided")
    for schedule, q_stages in (("queue", 3), ("strided", 0)):
        with pytest.raises(ValueError, match="q_stages"):
            gen.source(255, 255, schedule=schedule, q_stages=q_stages)


def test_every_schedule_has_one_signature_and_the_queue_takes_tickets():
    """One launch path: ``sem`` (the queue's ticket counter) comes before ``tmap_slots`` in every
    schedule's parameters; only the queue reads it."""
    for schedule in gen.SCHEDULES:
        text = gen.source(1023, 0, schedule=schedule)
        params = text.split("__launch_bounds__")[1].split(")")[1].replace("__restrict__ ", "")
        params = " ".join(params.split())
        assert params.endswith("float* lse, int* sem, uint8_t* tmap_slots"), params
        assert f"constexpr int SCHEDULE = {gen.SCHEDULES[schedule]};" in text
    queue = gen.program(1023, 0, schedule="queue")
    parts_ = {n: t for n, t in queue.headers if not n.endswith("config.cuh")}
    assert "atomicAdd(counter, 1)" in parts_["common/work_tickets.cuh"]
    # the kernel reads sem once, in the producer under the queue's branch: the backend zeroes it
    # only there (the kernel itself hands it to its parts' parameters)
    uses = [(n, line) for n, t in parts_.items() if n.startswith("fwd/") for line in t.splitlines()
            if re.search(r"\bp\.sem\b", line)]
    assert uses == [("fwd/producer.cuh",
                     "      w = publish_ticket(n, p.sem, sched.n_work, sm.ticket(), sm.item_full(0), "
                     "sm.item_empty(0));")]
    producer = parts_["fwd/producer.cuh"]
    before, branch = producer.split(uses[0][1])[0], "if (SCHEDULE == QUEUE) {"
    assert branch in before and "}" not in before.rsplit(branch, 1)[1]
    assert "enum : int { STRIDED = 1, QUEUE = 2 };" in parts_["fwd/params.cuh"]
    assert gen.SCHEDULES == {"strided": 1, "queue": 2}  # the kernel's enum, mirrored
    assert [s for s in gen.SCHEDULES if gen.takes_tickets(s)] == ["queue"]
    names = {gen.with_unique_name(gen.source(1023, 0, schedule=s))[0] for s in gen.SCHEDULES}
    assert len(names) == len(gen.SCHEDULES)
    sections = gen.source(None, 0, schedule="queue", section_bytes=16 << 20)
    assert "constexpr int SECTION_BYTES = 16777216;" in sections
    assert "constexpr int SECTION_BYTES = 0;" in gen.source(None, 0, schedule="queue")
    assert "constexpr long long SECTION_BYTES = 1099511627775LL;" in _config(
        gen.program(None, 0, schedule="queue", section_bytes=2**40 - 1))
    counted = "heads_per_section(SECTION_BYTES, 4LL * HEAD_DIM * max(Skv, 1), H * B)"
    assert counted in parts_["fwd/tile_scheduler.cuh"]
    assert gen.section_bytes_of(3, 1000) == 3 * 4 * gen.D * 1000  # the kernel's count, mirrored
    assert bwd.section_bytes_of(3, 2, 1000) == 3 * 4 * bwd.D * 2 * 1000  # the backward's (Q and dO)
    assert gen.with_unique_name(sections)[0] != gen.with_unique_name(gen.source(None, 0, schedule="queue"))[0]


def test_the_plan_picks_a_schedule_and_its_grid():

    pick = {name: (v.schedule, v.section_bytes, v.q_stages, v.o_store)
            for name, mask, runtime in (("dense", masks.full(), ""), ("causal", masks.causal(), ""),
                                        ("window", masks.sliding_window(1023, 0), ""),
                                        ("documents", masks.sliding_window(1023, 0), "ids"))
            for v in [plan.fwd_variant(mask.to_acsr(4096), 128, "bfloat16", runtime)]}
    # a second Q tile wherever it fits: not beside dense's 176-key tiles
    assert pick == {"dense": ("queue", 0, 1, "tma"),
                    "causal": ("queue", plan.QUEUE_SECTION_BYTES, 2, "tma"),
                    "window": ("strided", 0, 2, "tma"), "documents": ("strided", 0, 2, "tma")}
    bwd_pick = plan.bwd_variant(masks.causal().to_acsr(4096), 128, "bfloat16")
    assert bwd_pick.section_bytes == plan.BWD_SECTION_BYTES
    # the longest walks first at the end: causal's first key blocks
    bands = (masks.causal(), masks.sliding_window(1023, 0), masks.full(), masks.sliding_window(256, 256),
             masks.sliding_window(0, 60))
    orders = [plan.bwd_variant(m.to_acsr(4096), 128, "bfloat16").key_order for m in bands]
    assert orders == ["first_first_at_end"] + ["last_first"] * 4
    # block-local runs the band kernels measured from its blocks; dilated and strided folded
    local = plan.fwd_variant(masks.block_local(512, 1).to_acsr(4096), 128, "bfloat16")
    assert (local.band, local.band_block, local.schedule) == ((512, 511), 512, "strided")
    local_bwd = plan.offered_bwd_variant(masks.block_local(512, 1).to_acsr(4096), 128, "bfloat16")
    assert (local_bwd.band_block, local_bwd.key_order) == (512, "last_first")
    folded = ((masks.dilated_window(512, 2), (256, 256), 2), (masks.strided(64), (None, 0), 64))
    for mask, band, phases in folded:
        form = plan.band_form(mask.to_acsr(4096), 128, "bfloat16")
        assert (form.band, form.phases) == (band, phases)
        assert plan.fwd_variant(mask.to_acsr(4096), 128, "bfloat16").band == band
    for mask in (masks.dilated_window(512, 2), masks.block_local(512, 1)):
        with pytest.raises(NotImplementedError, match="runtime mask on plain bands only"):
            plan.band_form(mask.to_acsr(4096), 128, "bfloat16", "lengths")
    shape = (2, 1000, 3, 128)  # 8 row blocks, 48 work tiles
    assert plan.grid(shape, "strided", 132) == plan.grid(shape, "queue", 132) == (48, 1, 1)
    assert plan.grid(shape, "queue", 5) == (5, 1, 1)
    with pytest.raises(ValueError, match="schedule"):
        plan.grid(shape, False, 132)
    with pytest.raises(ValueError, match="schedule"):
        plan.FwdVariant(plan.fwd_variant(masks.causal().to_acsr(256), 128, "bfloat16").band, "bfloat16",
                        schedule="persistent")


VARIANTS = [  # (left, right, source kwargs): the backend's variants, then other schedules and tiles
    (None, None, dict(block_n=176)),
    (None, None, dict(block_n=176, dtype="float16")),
    (None, 0, {}),
    (1023, 0, {}),
    (256, 256, dict(dtype="float16")),
    (-7, 40, {}),
    (1023, 0, dict(schedule="strided")),
    (1023, 0, dict(schedule="queue")),
    (None, 0, dict(schedule="queue")),
    (None, 0, dict(schedule="queue", section_bytes=16 << 20)),
    (None, None, dict(block_n=176, schedule="queue", dtype="float16")),
    (-7, 40, dict(schedule="queue", stages=3)),
    (255, 255, dict(schedule="strided", q_stages=2)),
    (None, 0, dict(schedule="queue", section_bytes=16 << 20, q_stages=2)),
    (None, 0, dict(schedule="queue", section_bytes=16 << 20, q_stages=2, o_store="tma")),
    (1023, 0, dict(schedule="strided", q_stages=2, o_store="tma")),
    (None, None, dict(block_n=176, schedule="queue", o_store="tma")),
    (-7, 40, dict(schedule="queue", stages=3, o_store="tma")),
    (255, 0, dict(stages=3)),
    (512, 511, dict(schedule="strided", q_stages=2, o_store="tma", band_block=512)),
    (None, 199, dict(schedule="queue", section_bytes=16 << 20, q_stages=2, o_store="tma", band_block=200)),
    (192, 95, dict(schedule="strided", q_stages=2, o_store="tma", band_block=96, dtype="float16")),
]


def _variant_id(v) -> str:
    left, right, kwargs = v
    return f"{left},{right}," + (",".join(f"{a}={x}" for a, x in kwargs.items()) or "default")


@pytest.mark.parametrize("variant", VARIANTS, ids=_variant_id)
def test_variant_compiles_for_sm90a_with_at_most_a_few_bytes_spilled(cuda_compiler, variant):
    """No spills with NVRTC 13.5; NVRTC 13.0 (the H100 machine's) spills 4-8 bytes on the queue
    schedule's variants, whose producer lane holds the ticket state in 24 registers. Bounded."""
    left, right, kwargs = variant
    image, log = cuda_compiler.compile(gen.source(left, right, **kwargs), verbose=True)
    assert image[:4] == b"\x7fELF", "not a cubin"
    assert "warning" not in log.lower(), log
    assert int(re.search(r"(\d+) bytes spill stores", log).group(1)) <= 16, log
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    assert regs <= 168, log


def test_cubins_are_cached_on_disk(cuda_compiler, tmp_path, monkeypatch):
    monkeypatch.setenv("SPLAT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SPLAT_NO_DISK_CACHE", raising=False)
    src = gen.source(63, 0)
    before = compiler.stats()
    first = compiler.cubin(src)
    second = compiler.cubin(src)
    after = compiler.stats()
    assert first == second
    assert after["compiled"] - before["compiled"] == 1 and after["disk_hits"] - before["disk_hits"] == 1
    assert len(list((tmp_path / "cuda").glob("*.cubin"))) == 1


def test_a_compile_error_carries_the_log(cuda_compiler):
    with pytest.raises(compiler.CompileError, match="undefined|identifier"):
        cuda_compiler.compile(gen.source(0, 0).replace("fast_exp2(sc[i]", "no_such_fn(sc[i]"))


BWD_VARIANTS = [  # (left, right, bwd_source kwargs): the bands of tests/cuda_cases.py's kinds
    (None, None, {}),
    (None, None, dict(dtype="float16", ordered=False)),
    (None, 0, {}),
    (None, 170, dict(dtype="float16")),
    (1023, 0, {}),
    (256, 256, dict(ordered=False)),
    (40, -30, {}),
    (-1, 60, dict(dtype="float16")),
    (None, 0, dict(section_bytes=16 << 20)),
    (1023, 0, dict(section_bytes=1 << 20, ordered=False)),
    (None, 0, dict(key_order="first_first_at_end", section_bytes=16 << 20)),
    (1023, 0, dict(key_order="first_first", dtype="float16")),
    (None, None, dict(key_order="first_first")),
    (512, 511, dict(band_block=512, section_bytes=16 << 20)),
    (None, 199, dict(band_block=200, key_order="first_first_at_end", section_bytes=16 << 20)),
    (192, 95, dict(band_block=96, key_order="first_first", dtype="float16", ordered=False)),
]


@pytest.mark.parametrize("variant", BWD_VARIANTS, ids=_variant_id)
def test_backward_variant_compiles_for_sm90a(cuda_compiler, variant):
    """The producer warpgroup (ticket, loads, the dQ writers) runs on 24 registers a thread
    (``setmaxnreg``), so ptxas spills some of its item state: 68-148 bytes for these variants,
    outside the consumers' step loop (session 10 found almost all of it in the producer
    warpgroup). Bounded here."""
    left, right, kwargs = variant
    image, log = cuda_compiler.compile(bwd.bwd_source(left, right, **kwargs), verbose=True)
    assert image[:4] == b"\x7fELF", "not a cubin"
    assert "warning" not in log.lower(), log
    spills = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    assert spills <= 192, log
    assert int(re.search(r"Used (\d+) registers", log).group(1)) <= 168, log


RUNTIME_VARIANTS = [  # (generator, left, right, kwargs): the runtime-mask kinds on the plan's variants
    (gen.source, None, 0, dict(schedule="queue", section_bytes=16 << 20, runtime="ids")),
    (gen.source, None, None, dict(block_n=176, schedule="queue", runtime="ids", dtype="float16")),
    (gen.source, 255, 0, dict(schedule="strided", runtime="lengths")),
    (gen.source, 100, 100, dict(runtime="ids")),
    (bwd.bwd_source, None, 0, dict(runtime="ids")),
    (bwd.bwd_source, None, None, dict(runtime="lengths")),
    (bwd.bwd_source, 255, 0, dict(runtime="ids", dtype="float16", ordered=False)),
    (bwd.bwd_source, None, 0, dict(runtime="ids", key_order="first_first")),
    (bwd.bwd_source, 1023, 0, dict(runtime="lengths", key_order="first_first_at_end")),
]


@pytest.mark.parametrize("variant", RUNTIME_VARIANTS, ids=lambda v: f"{v[0].__name__},{_variant_id(v[1:])}")
def test_runtime_variants_compile_and_take_their_arrays(cuda_compiler, variant):
    """Each runtime kind adds its arrays to the signature after ``tmap_templates``. Spills stay
    bounded: the forward's producer lane holds the tile runs in 24 registers (up to 20 bytes with
    NVRTC 13.5, 36 with the H100 machine's 13.0 on the queue in sections with segment ids); the
    backward's ids path spills a few registers in its step too (NOTES.md, session 13)."""
    make, left, right, kwargs = variant
    text = make(left, right, **kwargs)
    names = gen.FWD_RUNTIME_ARRAYS if make is gen.source else bwd.BWD_RUNTIME_ARRAYS
    given = gen.runtime_arrays(kwargs["runtime"], names)
    start = text.index("__restrict__ tmap_templates,")
    macro = text[start:text.index("int Sq", start)].split(",")[1].strip()  # SPLAT_FWD_TABLES, _BWD_
    signature = text[text.index(f"#define {macro} "):].split("\n", 1)[0]
    assert [n for n in names if f"__restrict__ {n}," in signature] == list(given)
    locals_ = text[text.index(f"#define {macro.replace('TABLES', 'NO_TABLES')} "):].split("\n", 1)[0]
    nulls = [n for n in names if f"const int* {n} = nullptr;" in locals_]
    assert nulls == [n for n in names if n not in given]
    image, log = cuda_compiler.compile(text, verbose=True)
    assert image[:4] == b"\x7fELF" and "warning" not in log.lower(), log
    spills = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    assert spills <= (40 if make is gen.source else 256), log


SHIFTED_MASKS = {"causal": masks.causal(), "causal_window": masks.sliding_window(1023, 0),
                 "window": masks.sliding_window(255, 255), "dense": masks.full()}


@pytest.mark.parametrize("runtime", ["lengths", "ids"])
@pytest.mark.parametrize("mask", list(SHIFTED_MASKS))
def test_the_plans_shifted_variants_compile_with_lengths_of_four(cuda_compiler, mask, runtime):
    """Chunked prefill runs a variant of the band with ``shifted``: its ``rt_lens`` is ``[B, 4]``
    and the band is taken at the shifted rows; bands unbounded on the left take dense's wide key
    tiles, the others their band's plan. Spills stay bounded: the causal chunk with segment ids
    spills 48 bytes with NVRTC 13.5 (the producer lane's 24 registers hold the id runs and the
    shifted lengths; dense's unshifted ids variant spills 32)."""
    variant = plan.fwd_variant(SHIFTED_MASKS[mask].to_acsr(4096), 128, "bfloat16", runtime, shifted=True)
    plain = plan.fwd_variant(SHIFTED_MASKS[mask].to_acsr(4096), 128, "bfloat16", runtime)
    dense = plan.fwd_variant(masks.full().to_acsr(4096), 128, "bfloat16", runtime)
    like = dense if variant.band.left is None else plain
    assert variant.shifted and (variant.block_n, variant.schedule, variant.smem) == (
        like.block_n, like.schedule, like.smem)
    name, text = variant.named_source()
    assert "constexpr bool SHIFTED = true;" in text and name != plain.named_source()[0]
    image, log = cuda_compiler.compile(text, verbose=True)
    assert image[:4] == b"\x7fELF" and "warning" not in log.lower(), log
    assert int(re.search(r"(\d+) bytes spill stores", log).group(1)) <= 48, log


OFF_PLAIN_BANDS = {"dilated": masks.dilated_window(256, 2).to_acsr(1024),
                   "block_local": masks.block_local(512, 1).to_acsr(1024),
                   "neighborhood": masks.neighborhood((16, 16), 3).to_acsr()}


@pytest.mark.parametrize("layout", list(OFF_PLAIN_BANDS.values()), ids=list(OFF_PLAIN_BANDS))
def test_shifted_queries_are_refused_off_plain_bands(layout):
    with pytest.raises(NotImplementedError, match="q_offset|query positions|runtime mask|one-band"):
        plan.fwd_variant(layout, 128, "bfloat16", "lengths", shifted=True)
    with pytest.raises(ValueError, match="shifted"):
        gen.source(None, 0, shifted=True)


def test_backward_shared_memory_and_names():
    assert bwd.smem_bytes(2) <= gen.SMEM_LIMIT < bwd.smem_bytes(3)
    a, b = (bwd.with_unique_name(bwd.bwd_source(None, 0, ordered=o)) for o in (True, False))
    assert a[0] != b[0] and a[0].startswith("splat_bwd_") and bwd.KERNEL_NAME not in a[1]
    assert "constexpr int LEFT = 1073741824;" in a[1] and "constexpr int RIGHT = 0;" in a[1]


def test_backward_sections_are_baked_in_and_checked():
    """``section_bytes``: the (batch, KV head)s whose groups' Q and dO fit it are taken in turn (0:
    one at a time, the count in the kernel at least 1); bad values are refused by name."""
    assert "constexpr int SECTION_BYTES = 16777216;" in bwd.bwd_source(None, 0, section_bytes=16 << 20)
    assert "constexpr int SECTION_BYTES = 0;" in bwd.bwd_source(None, 0)
    assert "heads_per_section(SECTION_BYTES, 4LL * HEAD_DIM * G * max(p.Sq, 1)" in bwd.bwd_source(None, 0)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="section_bytes"):
            bwd.bwd_source(None, 0, section_bytes=bad)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_backwards_passes_compile_for_sm90a_without_spills(cuda_compiler, dtype):
    """delta before the backward kernel and dq's rows after it (``bwd_passes``)."""
    for kernel in bwd_passes.KERNELS:
        text = bwd_passes.pass_source(kernel, dtype).replace("__NAME__", "splat_pass")
        image, log = cuda_compiler.compile(text, verbose=True)
        assert image[:4] == b"\x7fELF", "not a cubin"
        assert "warning" not in log.lower(), log
        assert " 0 bytes spill stores" in log, log


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_dq_from_acc_inverts_the_kernels_fragment_order(head_dim):
    """Each consumer thread stores its dQ fragment (row 16 (warp % 4) + lane / 4 + 8 ((e / 2) % 2),
    column n wg + 8 (e / 4) + 2 (lane % 4) + pair, n = HD / 2 its warpgroup's columns, HD the head
    dim padded to 64-column blocks) at float ``wg * 64 n + ((e / 2) * 128 + tid % 128) * 2 + pair``
    of its query block: the kernel's addressing, written out here per element."""
    B, H, Sq = 2, 3, 100
    n = gen.padded_head_dim(head_dim) // 2
    rng = np.random.default_rng(0)
    dq = rng.standard_normal((B, bwd.num_q_blocks(Sq) * bwd.BM, H, 2 * n)).astype(np.float32)
    acc = np.zeros(bwd.dq_acc_shape(B, H, Sq, head_dim), np.float32)
    for tid in range(256):
        wg, warp, lane = tid // 128, (tid // 32) % 4, tid % 32
        for e in range(n // 2):
            r = 16 * warp + lane // 4 + 8 * ((e // 2) % 2)
            c = n * wg + 8 * (e // 4) + 2 * (lane % 4) + e % 2
            flat = wg * 64 * n + ((e // 2) * 128 + tid % 128) * 2 + e % 2
            for i in range(acc.shape[2]):
                acc[:, :, i, flat] = dq[:, i * bwd.BM + r, :, c]
    np.testing.assert_array_equal(bwd.dq_from_acc(acc, Sq, head_dim=head_dim), dq[:, :Sq, :, :head_dim])


@pytest.mark.parametrize("xp", ["numpy", "jax"])
def test_dq_from_acc_zeroes_rows_that_see_no_key_whatever_the_buffer_holds(xp):
    """The ordered kernel never writes a query block that no key block reaches, and its ``dq_acc``
    is not zeroed: rows with ``lse = -inf`` must come out 0 even over NaN; the rest untouched."""
    import jax.numpy as jnp

    mod = np if xp == "numpy" else jnp
    B, H, Sq = 2, 3, 100
    rng = np.random.default_rng(1)
    acc = rng.standard_normal(bwd.dq_acc_shape(B, H, Sq)).astype(np.float32)
    acc[:, :, 1] = np.nan  # rows 64..99: a block nobody wrote
    lse = rng.standard_normal((B, H, Sq)).astype(np.float32)
    lse[:, :, 64:] = -np.inf
    lse[0, 1, 5] = -np.inf  # a row inside a written block that sees nothing
    got = np.asarray(bwd.dq_from_acc(mod.asarray(acc), Sq, mod.asarray(lse)))
    want = bwd.dq_from_acc(acc, Sq)
    assert not got[:, 64:].any() and not got[0, 5, 1].any()
    np.testing.assert_array_equal(got[:, :64][lse.transpose(0, 2, 1)[:, :64] > -np.inf],
                                  want[:, :64][lse.transpose(0, 2, 1)[:, :64] > -np.inf])


@pytest.mark.parametrize("kwargs, name", [(dict(stages=0), "stages"), (dict(dtype="float32"), "dtype"),
                                          (dict(left=1.5), "left"), (dict(right=True), "right"),
                                          (dict(runtime="segments"), "runtime"),
                                          (dict(key_order="first"), "key_order"),
                                          (dict(band_block=-1), "band_block")])
def test_backward_bad_arguments_are_named(kwargs, name):
    args = dict(left=None, right=0) | kwargs
    with pytest.raises(ValueError, match=name):
        bwd.bwd_source(args.pop("left"), args.pop("right"), **args)


def test_the_backward_is_offered_where_key_blocks_walk_10_query_blocks():

    for mask in (masks.full(), masks.causal(), masks.sliding_window(1023, 0), masks.sliding_window(256, 256)):
        assert plan.offered_bwd_variant(mask.to_acsr(4096), 128, "bfloat16").ordered
    with pytest.raises(NotImplementedError, match="this one: 384"):
        plan.offered_bwd_variant(masks.sliding_window(128, 128).to_acsr(4096), 128, "bfloat16")
