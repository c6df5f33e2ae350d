"""Point-to-point messages between the processes of a job, for the peer tier's copies.

A :class:`PeerLink` sends and receives byte buffers between ranks on a gloo process group
of its own (never the training loop's, nor the coordinator's collectives), so a copy in
flight never interleaves with another collective. One :meth:`PeerLink.exchange` posts
every send and receive of one round at once and waits for all of them, within the link's
timeout plus the time its largest buffer takes at :data:`SLOWEST_BYTES_PER_SECOND`: a
partner that died or hangs costs at most that long. A save's copy moves a shard in pieces
(:data:`~tiered_ckpt.tiers.peer.copies.PIECE_BYTES`), an exchange each, within one limit for
the whole shard (``deadline``) and one per piece: a partner that stops mid-copy costs one
piece's limit, and one that keeps answering slower than the rate no more than the shard's.

After a round that failed or timed out, a receive may still be posted in the backend and
a late message could land in a buffer reused since, so the link is *broken* for the rest
of the run: every later exchange raises at once, with the first failure's reason.
Messages carry no pickle: raw bytes, and headers of fixed-size integers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import numpy as np

from tiered_ckpt.errors import PeerError, UsageError

__all__ = ["PeerLink", "SLOWEST_BYTES_PER_SECOND"]

# A round moving a large shard may take longer than one of a few bytes: its limit grows by
# the time this rate takes to move it. A link slower than that counts as hung.
SLOWEST_BYTES_PER_SECOND = 50e6


class PeerLink:
    """Byte messages between the ranks of ``coordinator`` (a
    :class:`~tiered_ckpt.TorchDistributedCoordinator`; building the link is collective), each
    exchange bounded by ``timeout_seconds``."""

    def __init__(self, coordinator: Any, timeout_seconds: float) -> None:
        import torch.distributed as dist  # an optional dependency: imported only when used

        self._dist = dist
        self.rank: int = coordinator.rank
        self.timeout_seconds = timeout_seconds
        self._group = coordinator.new_group(timedelta(seconds=timeout_seconds))
        self.broken: str | None = None
        self._abandoned: list[Any] = []  # the operations of the exchange that broke the link

    def __repr__(self) -> str:
        return f"PeerLink(rank={self.rank}, timeout_seconds={self.timeout_seconds})"

    def exchange(
        self,
        sends: Sequence[tuple[int, np.ndarray]],
        receives: Sequence[tuple[int, np.ndarray]],
        *,
        deadline: float | None = None,
    ) -> None:
        """Send each ``(rank, buffer)`` of ``sends`` and fill each of ``receives`` from its rank, all at once.

        Buffers are C-contiguous uint8 arrays (a receive's must have exactly the sender's
        length). Raises :class:`PeerError` (``transient=False``) if any of them failed or did
        not finish in time (see the module doc), or by ``deadline`` (a ``time.monotonic()``:
        that of a whole transfer this exchange is a piece of); the link is then broken.
        """
        import torch

        if self.broken is not None:
            raise PeerError(f"rank {self.rank}: the peer link is broken since: {self.broken}", transient=False)
        largest = max((buffer.size for _rank, buffer in (*sends, *receives)), default=0)
        limit = self.timeout_seconds + largest / SLOWEST_BYTES_PER_SECOND
        if deadline is not None:
            limit = max(min(limit, deadline - time.monotonic()), 0.001)
        deadline = time.monotonic() + limit
        works = []
        try:
            for rank, buffer in sends:
                if buffer.size:
                    tensor = _tensor(torch, buffer)
                    works.append((rank, self._dist.isend(tensor, group=self._group, group_dst=rank), tensor))
            for rank, buffer in receives:
                if buffer.size:
                    tensor = _tensor(torch, buffer)
                    works.append((rank, self._dist.irecv(tensor, group=self._group, group_src=rank), tensor))
            for rank, work, _tensor_kept in works:
                if work is None:  # this process is not in the group: never the case for a link's own group
                    raise PeerError(f"rank {self.rank}: not a member of the peer link's group", transient=False)
                left = max(deadline - time.monotonic(), 0.001)
                try:
                    work.wait(timeout=timedelta(seconds=left))
                except Exception as exc:  # the backend's own types (RuntimeError, DistBackendError) vary
                    raise PeerError(
                        f"rank {self.rank}: no answer from rank {rank} within {limit:.1f} s "
                        f"(it died or hangs): {_first_line(exc)}",
                        transient=False,
                    ) from exc
        except PeerError as exc:
            self.broken = str(exc)
            self._abandoned = works  # the backend may still write into them: never freed
            raise
        except Exception as exc:  # posting failed: the backend refused the group or a peer is gone
            self.broken = f"rank {self.rank}: {_first_line(exc)}"
            self._abandoned = works
            raise PeerError(f"rank {self.rank}: the peer link failed: {_first_line(exc)}", transient=False) from exc


def _tensor(torch: Any, buffer: np.ndarray) -> Any:
    if buffer.dtype != np.uint8 or buffer.ndim != 1 or not buffer.flags.c_contiguous:
        raise UsageError("peer link buffers are 1-D C-contiguous uint8 arrays")
    return torch.from_numpy(buffer)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
