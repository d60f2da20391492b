"""The sizes and masks the cuda-backend profiling scripts time (issue 10's four: dense, causal,
causal window 1024, sliding window (256, 256); and the catalogue's block-local, a band measured
from each block's first row) and their timer; imported by ``profile_bwd.py`` and
``profile_timeline.py`` beside this one, and by the cuda spikes in ``spikes/``."""

from splat import catalogue, masks
from splat.tools import timing

D, H = 128, 16  # head dim, heads
SCALE = D**-0.5
MASKS = {
    "full": masks.full(),
    "causal": masks.causal(),
    "causal_window_1024": masks.sliding_window(1023, 0),
    "sliding_window_256": masks.sliding_window(256, 256),
    "block_local": catalogue.named("block_local"),
}


def chained_ms(fn, args, feed, n=10) -> float:
    """Milliseconds a call of ``fn(*args)``, timed as ``n`` calls chained in one jitted program
    (``feed``: which output feeds which argument of the next call)."""
    _, launch, sync = timing.compile_timed(fn, args, n, feed)
    return timing.time_call(None, 2, 5, launch=launch, sync=sync, per_sample=n, calls_per_launch=n)["ms"]
