"""``python -m splat``: the ``splat`` command line (:mod:`splat.tools.cli`)."""

import sys


def _main() -> int:
    from splat.tools.cli import main  # the tooling loads only when the command runs

    return main()


if __name__ == "__main__":
    sys.exit(_main())
