"""Another revision's kernel generator swapped into this one, for the ``--baseline`` of the cuda
spikes beside this file. Since the kernels became CUDA files (c19f482) this raises
``NotImplementedError``: time another revision by running the spike in its own checkout."""

import contextlib
import importlib.util

from jax_bindings._cuda import source


def load_generator(path: str):
    """Another revision's ``jax_bindings/_cuda/source.py`` (or ``bwd_source.py``) as a module
    (``git show REV:jax_bindings/_cuda/source.py > FILE``), for a spike's baseline."""
    spec = importlib.util.spec_from_file_location("baseline_source", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def generating_with(generator, target=source):
    """Within the block, ``target`` (this revision's generator module: ``source``, or
    ``bwd_source``) writes the kernel text of ``generator`` (the same module of another revision,
    from :func:`load_generator`) with this revision's substitutions and helpers.

    Only revisions whose generators were text templates swap: since the kernels moved to CUDA files
    (``jax_bindings/_cuda/kernels/``) a module holds no kernel text, and another revision is timed
    by running the spike in its own checkout."""
    if not hasattr(target, "_KERNEL"):
        raise NotImplementedError(
            "this revision's kernels are CUDA files under jax_bindings/_cuda/kernels/, not a text "
            "template to swap: run the spike in the other revision's checkout for its baseline")
    names = [n for n in ("_HELPERS", "_KERNEL") if hasattr(target, n)]
    if target is source:
        names.insert(0, "HELPERS")
    keep = {n: getattr(target, n) for n in names}
    try:
        for n in names:
            setattr(target, n, getattr(generator, n))
        yield
    finally:
        for n, text in keep.items():
            setattr(target, n, text)
