"""What :meth:`~tiered_ckpt.CheckpointManager.save` returns: the futures of a save's commits,
and what the call cost the caller (:class:`SaveHandle`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from tiered_ckpt.errors import UploadError
from tiered_ckpt.format.manifest import ShardManifest

__all__ = ["SaveHandle", "not_replicated"]


class SaveHandle:
    """The pending result of one :meth:`CheckpointManager.save`, as futures.

    ``committed`` is the local commit: its result is the step's manifest once every rank's
    shard is durable and the manifest is in place (for a step kept in a partner's memory
    only, once it is committed there), or None for a step in no tier: no tier's cadence took
    it, or the partners' memory, its only tier, did not keep it (logged, never raised); its
    exception is the :class:`SaveError` (cause chained) of a save that failed. ``uploaded`` is the commit
    in the bucket (None only without one): its result is None once the bucket holds the step;
    its exception is the step's :class:`UploadError` (it failed, missed its deadline, was
    superseded by a newer step, the manager closed first, or the step never goes to the
    bucket: its cadence skips it, ``tries`` 0), or the save's :class:`SaveError`. ``replicated``
    holds such a future for every later tier, by its name (the bucket's is ``uploaded``). An
    error raised by any one's ``result()`` is not raised again by the manager's next call.

    What the call cost the caller: ``blocked_seconds``, how long ``save`` held it (the check,
    the copy, and any wait: ``blocking=True``, or the budget's); ``staged_bytes``, the bytes
    copied into the staging buffers (``runtime.host_memory_bytes``); ``throttled_bytes``, those
    past the budget, written straight from the caller's memory while the call waited
    ``throttled_seconds`` for them (0 when the state fits the budget).
    """

    def __init__(
        self,
        step: int,
        committed: Future[ShardManifest | None],
        uploaded: Future[None] | None,
        replicated: Mapping[str, Future[None]] | None = None,
    ) -> None:
        self.step = step
        self.committed = committed
        self.uploaded = uploaded
        self.replicated: Mapping[str, Future[None]] = dict(replicated or {})
        self.blocked_seconds = 0.0
        self.staged_bytes = 0
        self.throttled_bytes = 0
        self.throttled_seconds = 0.0

    @classmethod
    def skipped(cls, step: int, *, later: Sequence[str] = (), bucket: str | None = None) -> SaveHandle:
        """The handle of a save that saved nothing: no tier's cadence takes ``step``; each of the
        ``later`` tiers (by name; ``bucket``, the bucket's) has a future that says the step is not there."""
        nothing: Future[ShardManifest | None] = Future()
        nothing.set_result(None)
        why = "no tier's cadence takes it"
        replicated = {name: not_replicated(step, name, bucket, why) for name in later}
        return cls(step, nothing, replicated.get(bucket) if bucket is not None else None, replicated)

    def __repr__(self) -> str:
        def state(future: Future[Any] | None) -> str:
            if future is None:
                return "none"
            return "pending" if not future.done() else "failed" if future.exception() else "done"

        return f"SaveHandle(step={self.step}, committed={state(self.committed)}, uploaded={state(self.uploaded)})"


def not_replicated(step: int, name: str, bucket: str | None, why: str) -> Future[None]:
    """The future of a step that never goes to the later tier called ``name`` (``bucket``: the
    bucket's name): failed at once with an :class:`UploadError` of no tries saying ``why``. A
    waiting loop gets a typed answer for every save, as for a step left local-only, rather than
    no future at all."""
    future: Future[None] = Future()
    what = "uploaded" if name == bucket else f"copied to the {name} tier"
    future.set_exception(UploadError(f"step {step} is not {what}: {why}", step=step, tries=0))
    return future
