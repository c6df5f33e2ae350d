"""The environment variables the library reads its options from: their prefix.

Its own module, with nothing to import, so that ``tiered-ckpt --help`` names them without
importing the options (see :mod:`tiered_ckpt.config` for how each variable is read).
"""

from __future__ import annotations

__all__ = ["ENV_PREFIX"]

ENV_PREFIX = "TIERED_CKPT_"
"""The prefix of every variable: ``TIERED_CKPT_<TABLE>_<KEY>`` sets ``<table>.<key>``."""
