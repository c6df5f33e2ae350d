"""The bounds of every numeric option, and the one check of a number against them.

A number an option accepts is used as it is, far from where it was given: seconds in
``time.monotonic()`` arithmetic, in thread waits (which refuse more than
``threading.TIMEOUT_MAX``, about 292 years on Linux), in ``datetime.timedelta`` (the peer
tier's links) and in socket timeouts; counts in comparisons with step numbers and in JSON.
Each bound here is far beyond any run and within what every consumer takes, so a value
that passes :func:`check_number` never fails later (an upload, a lease renewal, a start-up).
"""

from __future__ import annotations

import math
from typing import Any, cast

from tiered_ckpt.errors import invalid_option
from tiered_ckpt.format.validate import MAX_STEP

__all__ = ["MAX_SECONDS", "MAX_COUNT", "MAX_PART_BYTES", "check_number", "shown"]

# About 31.7 years: 9 times below threading.TIMEOUT_MAX and socket timeouts' limit (both
# about 9.2e9 s), far below timedelta's (8.6e13 s), and exact in a float added to any clock.
MAX_SECONDS = 1e9
# A count or cadence (steps to keep, every how many steps, tries, threads, bytes) beyond the
# largest step means nothing more, and an int64 is what every reader of a number parses.
MAX_COUNT = MAX_STEP
# An object below twice the part size goes up in one request: S3 takes one of at most 5 GiB,
# Azure's Put Blob one of at most 5000 MiB (and a block of at most 4000 MiB).
MAX_PART_BYTES = 2 << 30


def shown(value: int | float) -> str:
    """``value`` as a message shows it: an int too long to print whole (10**400) by its size."""
    if isinstance(value, int) and abs(value) >= 10**20:
        return f"{'-' if value < 0 else ''}about 10**{math.floor(math.log10(abs(value)))}"
    return repr(value)


def _shown_bound(bound: float) -> str:
    if bound == MAX_STEP:
        return "2**63 - 1"
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def check_number(
    name: str, value: Any, minimum: float, maximum: float, types: tuple[type, ...] = (int,), *, hint: str = ""
) -> None:
    """Raise the :class:`~tiered_ckpt.ConfigError` of option ``name`` unless ``value`` is of ``types``
    (never a bool), finite, and in ``[minimum, maximum]``; ``hint`` ends each message
    (``" (or None: keep all)"``)."""
    if isinstance(value, bool) or not isinstance(value, types):
        expected = " or ".join(t.__name__ for t in types)
        raise invalid_option(name, f"must be {expected}, got {type(value).__name__} {value!r:.60}{hint}")
    number = cast(float, value)  # an int or a float, as checked
    if isinstance(number, float) and not math.isfinite(number):  # nan passes every comparison
        raise invalid_option(name, f"must be a finite number, got {number!r}{hint}")
    if number < minimum:
        raise invalid_option(name, f"must be >= {minimum}, got {shown(number)}{hint}")
    if number > maximum:
        raise invalid_option(name, f"must be <= {_shown_bound(maximum)}, got {shown(number)}{hint}")
