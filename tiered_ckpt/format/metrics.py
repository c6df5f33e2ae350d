"""A step's metrics: the numbers a save records in its manifest, for keep-best retention.

``manager.save(step, state, metrics={"val_loss": 0.25})`` records them;
:attr:`~tiered_ckpt.format.manifest.ShardManifest.metrics` holds them as sorted
``(name, value)`` pairs (a tuple: what is stored is frozen). A value is a finite float, or
None where the caller's was not finite (a diverged loss is ``nan``): such a step is never
among a metric's best, and the save still succeeds, since a metric must never be the reason
a job loses its checkpoint.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from tiered_ckpt.errors import InvalidStateError, ManifestError

__all__ = ["Metrics", "GivenMetrics", "MAX_METRICS", "MAX_METRIC_NAME", "metrics_of", "parse_metrics"]

logger = logging.getLogger("tiered_ckpt")

Metrics = tuple[tuple[str, float | None], ...]
"""A step's metrics, sorted by name; None for a value that was not finite."""

GivenMetrics = Mapping[str, Any]
"""A save's ``metrics`` argument: names to numbers (see :func:`metrics_of`)."""

MAX_METRICS = 64  # a few scores a run ranks its steps by, not a log: the manifest stays small
MAX_METRIC_NAME = 200


def _name_problem(name: object) -> str | None:
    if not isinstance(name, str):
        return f"a metric's name must be a string, got {type(name).__name__}"
    if not name or len(name) > MAX_METRIC_NAME or not name.isprintable():
        return f"a metric's name must be 1 to {MAX_METRIC_NAME} printable characters, got {name[:80]!r}"
    return None


def metrics_of(given: GivenMetrics | None, step: int) -> Metrics:
    """The metrics a save of ``step`` records from the caller's ``given`` (None: none).

    A value is a real number: a Python or numpy number, or a one-element array or tensor of
    one (not a bool, a complex number nor text, which ``float()`` would take too). A value
    that is not finite is recorded as None, with a WARNING. Raises :class:`InvalidStateError`
    naming the metric for anything else.
    """
    if given is None:
        return ()
    if not isinstance(given, Mapping):
        raise InvalidStateError(f"metrics must be a dict of names to numbers, got {type(given).__name__}")
    if len(given) > MAX_METRICS:
        raise InvalidStateError(f"metrics holds {len(given)} values; a step records at most {MAX_METRICS}")
    pairs: list[tuple[str, float | None]] = []
    for name, value in given.items():
        problem = _name_problem(name)
        if problem is not None:
            raise InvalidStateError(f"metrics: {problem}")
        if isinstance(value, (str, bytes, bool, complex)) or _not_real(value):
            raise InvalidStateError(
                f"metrics[{name!r}] must be a real number, got {type(value).__name__} {value!r:.40}"
            )
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:  # RuntimeError: several elements
            raise InvalidStateError(f"metrics[{name!r}] must be a number, got {type(value).__name__}: {exc}") from None
        if not math.isfinite(number):
            logger.warning("step %d: metric %r is %s; recorded as no value (never among the best)", step, name, number)
        pairs.append((name, number if math.isfinite(number) else None))
    return tuple(sorted(pairs))


def _not_real(value: object) -> bool:
    """Whether ``value`` is an array or tensor of booleans, complex numbers, text or objects,
    which ``float()`` would take (or half take) all the same."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return False
    if hasattr(dtype, "is_complex"):  # a torch dtype
        return bool(dtype.is_complex) or str(dtype) == "torch.bool"
    return getattr(dtype, "kind", "") in ("b", "c", "S", "U", "O", "M", "m")


def parse_metrics(document: object, source: str) -> Metrics:
    """A manifest's ``metrics`` field (untrusted): an object of names to finite numbers or null.
    Raises :class:`ManifestError` naming ``source`` and the metric."""

    def fail(problem: str) -> ManifestError:
        return ManifestError(f"{source}: field 'metrics': {problem}")

    if not isinstance(document, dict):
        raise fail(f"expected an object, got {type(document).__name__}")
    if len(document) > MAX_METRICS:
        raise fail(f"holds {len(document)} values, at most {MAX_METRICS} are read")
    pairs: list[tuple[str, float | None]] = []
    for name, value in document.items():
        problem = _name_problem(name)
        if problem is not None:
            raise fail(problem)
        number = _finite(value)
        if value is not None and number is None:
            raise fail(f"{name!r} must be a finite number or null, got {type(value).__name__} {str(value)[:40]}")
        pairs.append((name, number))
    return tuple(sorted(pairs))


def _finite(value: object) -> float | None:
    """``value`` as a finite float, if it is a JSON number that is one (an integer too large for
    a float is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None
