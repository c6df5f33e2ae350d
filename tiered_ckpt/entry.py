"""The ``tiered-ckpt`` command's entry point (and ``python -m tiered_ckpt``'s).

Its own module, importing only the parser, so that ``tiered-ckpt --help`` answers before the
commands' modules (numpy, fsspec, the tiers: most of a second) are imported.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from tiered_ckpt.cli_parser import build_parser, run_quietly

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """The ``tiered-ckpt`` command (and ``python -m tiered_ckpt``): ``--help``, ``--version`` and
    a usage error end here, before the commands' modules (numpy, fsspec, the tiers) are
    imported; anything else runs in :func:`tiered_ckpt.cli.run`."""
    arguments = list(sys.argv[1:] if argv is None else argv)

    def parse_then_run() -> int:
        if arguments[:1] != ["demo"]:  # the demo parses its own arguments
            build_parser().parse_args(arguments)
        from tiered_ckpt.cli import run

        return run(arguments)

    return run_quietly(parse_then_run)
