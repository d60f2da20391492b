"""The sizes and masks the cuda-backend spikes time (issue 10's four: dense, causal, causal window
1024, sliding window (256, 256)); imported by the scripts beside this one."""

from splat import masks

D, H = 128, 16  # head dim, heads
SCALE = D**-0.5
MASKS = {
    "full": masks.full(),
    "causal": masks.causal(),
    "causal_window_1024": masks.sliding_window(1023, 0),
    "sliding_window_256": masks.sliding_window(256, 256),
}
