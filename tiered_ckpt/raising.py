"""How the background stages' failures reach the caller: on its thread, each once.

The writer and the replicators leave their failures in one
:class:`~tiered_ckpt.engine.background.ErrorBox`; the manager raises them with these at
``save``, ``wait`` and ``close`` (and inside the collectives of save and restore, where
every rank raises together), as :class:`~tiered_ckpt.CheckpointManager` documents.
A step that only missed its upload deadline is its own case: raised by ``wait(uploaded=True)``
(whose caller asked for the bucket's copy), logged by ``close``, never raised by ``save``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from tiered_ckpt.engine.background import ErrorBox
from tiered_ckpt.errors import UploadError, restated

__all__ = ["raise_waited", "raise_closed", "raised_on_every_rank"]

logger = logging.getLogger("tiered_ckpt")


def raise_waited(errors: ErrorBox, *, uploaded: bool) -> None:
    """Raise the oldest failure not yet raised other than a missed deadline; with ``uploaded``,
    then the steps that missed their upload deadline, as one error naming them all (``step``
    the newest; each step is raised once)."""
    errors.raise_first(transient=False)
    missed = errors.take_transient() if uploaded else []
    if len(missed) == 1:
        raise missed[0]
    if missed:
        steps = ", ".join(str(error.step) for error in missed)
        last = missed[-1]
        message = f"steps {steps} missed their upload deadline and stay local-only; the last: {last}"
        raise restated(last, message) from last.__cause__


def raise_closed(errors: ErrorBox, name: str) -> None:
    """After the parts of ``name`` closed: log (WARNING) each step that missed its upload deadline
    (it is safe on local disk, and the next start uploads it), then raise any other failure."""
    for missed in errors.take_transient():
        logger.warning("closing %s: step %d is on local disk only: %s", name, missed.step, missed)
    errors.raise_first()


@contextmanager
def raised_on_every_rank(errors: ErrorBox) -> Iterator[None]:
    """Around the collectives of save and restore, where background errors are raised by every rank.

    A rank's uploader may record a failed upload (agreed by every rank's uploader) a moment
    before or after another's: the rank that has it raises it inside the collective, so every
    rank raises it at the same call, and the others' copies, when they arrive, are not raised again.
    """
    try:
        yield
    except UploadError as error:
        errors.mark_raised(error)
        raise
