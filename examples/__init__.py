"""Runnable examples (Flax NNX models on splat); see examples/README.md."""
