"""Tooling around splat, not part of the library: ``import splat`` loads none of it.

===================  ==============================================================
module               what
===================  ==============================================================
``cli``              the ``splat`` command (``analyze``, ``bench``, ``bench-runtime``, ``tune``)
``bench``            ``splat bench``: settings, the run, its table and JSON
``bench_runtime``    ``splat bench-runtime``: runtime masks (packed documents, soft cap) on a GPU
``peers``            the implementations splat is timed against
``mask_forms``       a splat mask in each peer's terms (band, expression, FA3 args)
``timing``           how a call is timed (samples, chained JAX executables)
``check``            each peer's output against splat's
``plot``             PNG pictures of a mask and of benchmark results (matplotlib)
===================  ==============================================================

Imports run one way: ``cli -> {bench, bench_runtime, peers, plot}``, ``bench_runtime ->
{bench, check, mask_forms, peers, timing}``, ``bench -> {check, peers, timing}``,
``check -> peers -> {mask_forms, timing}``; ``plot`` imports none of them.
The library never imports this package.
"""
