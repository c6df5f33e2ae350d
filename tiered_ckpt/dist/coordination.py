"""How the processes of a job agree: which ranks a process holds, who commits, barriers.

A :class:`Coordinator` is what :class:`~tiered_ckpt.CheckpointManager` asks whenever
more than one process could be involved. Payloads are small JSON values (shard records,
step numbers, error descriptions); the one exception is :meth:`Coordinator.broadcast_array`,
which a restore uses to hand a rank the replicated arrays another rank's shard holds.

:class:`SingleProcessCoordinator` is one process holding
every rank's state, so it is the leader, gathers from itself and needs no barrier.

:class:`TorchDistributedCoordinator` is one process per rank under ``torch.distributed``.
Its collectives run on a process group of its own (gloo, created when it is built), so
a save finishing in a background thread never interleaves with the training loop's
collectives; :meth:`Coordinator.new_channel` gives the uploader thread a second group
so that the writer's and the uploader's collectives cannot interleave either.

Two labelled collectives carry every multi-process step of a checkpoint: :func:`gather`
(each process runs its part and every process gets every part) and :func:`leader_decides`
(the leader runs it and every process gets its decision). Either every process gets the
payloads or every process raises, with the label naming the collective that failed.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import numpy as np

from tiered_ckpt import errors
from tiered_ckpt.errors import CheckpointError, ConfigError, CoordinationError, UsageError, invalid_option
from tiered_ckpt.io.gc_pause import cyclic_gc_paused

__all__ = [
    "Coordinator",
    "SingleProcessCoordinator",
    "TorchDistributedCoordinator",
    "Attempt",
    "Done",
    "gather",
    "leader_decides",
    "resolve_coordinator",
    "to_payload",
    "from_payload",
    "decode_gathered",
]

T = TypeVar("T")
P = TypeVar("P")


@runtime_checkable
class Coordinator(Protocol):
    """The collective operations a checkpoint needs across the processes of a job."""

    @property
    def world_size(self) -> int:
        """Number of ranks in the job."""
        ...

    @property
    def local_ranks(self) -> Sequence[int]:
        """The ranks whose state this process saves and restores.

        Concatenated in process order, the processes' local ranks are ``0 .. world_size-1``.
        """
        ...

    @property
    def is_leader(self) -> bool:
        """True on the one process that commits manifests and decides which step to restore."""
        ...

    def barrier(self) -> None:
        """Return once every process has called it."""
        ...

    def all_gather(self, payload: Any) -> list[Any]:
        """Return every process's payload, in process order, on every process."""
        ...

    def broadcast(self, payload: Any) -> Any:
        """Return the leader's payload on every process."""
        ...

    def broadcast_array(self, array: np.ndarray, source: int) -> None:
        """Fill ``array`` (C-contiguous, writable, of the same dtype and shape on every process)
        with the process ``source``'s ``array`` (``source`` is that process's first rank)."""
        ...

    def new_channel(self) -> Coordinator:
        """A coordinator over the same processes whose collectives never interleave with this one's.

        Every process must call it, in the same order (it is itself collective).
        """
        ...


class SingleProcessCoordinator:
    """One process that holds all ``world_size`` ranks (simulated ranks)."""

    def __init__(self, world_size: int) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise invalid_option("world_size", f"must be an integer >= 1, got {world_size!r:.40}")
        self._world_size = world_size

    def __repr__(self) -> str:
        return f"SingleProcessCoordinator(world_size={self._world_size})"

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_ranks(self) -> Sequence[int]:
        return range(self._world_size)

    @property
    def is_leader(self) -> bool:
        return True

    def barrier(self) -> None:
        return None

    def all_gather(self, payload: Any) -> list[Any]:
        return [payload]

    def broadcast(self, payload: Any) -> Any:
        return payload

    def broadcast_array(self, array: np.ndarray, source: int) -> None:
        if not 0 <= source < self._world_size:
            raise UsageError(f"source must be a rank of 0..{self._world_size - 1}, got {source}")

    def new_channel(self) -> SingleProcessCoordinator:
        return self


class TorchDistributedCoordinator:
    """One process per rank under ``torch.distributed`` (which must be initialized).

    ``group`` (default: every process of the job) names the ranks taking part; a rank's
    number is its rank in that group. The collectives do not run on ``group`` itself
    but on a new gloo group over the same ranks, created here (a collective call: every
    rank of the job, or of ``group``, must build its coordinator at the same point).
    So they work whatever backend trains the model (NCCL included) and never race its
    collectives, whichever thread calls them. ``timeout`` bounds each collective (a rank
    that died makes the others fail after it rather than hang); None keeps torch's
    default. Payloads travel as JSON bytes, never pickled.
    """

    def __init__(self, group: Any = None, *, timeout: timedelta | None = None) -> None:
        import torch.distributed as dist  # an optional dependency: imported only when used

        if not dist.is_available() or not dist.is_initialized():
            raise UsageError("TorchDistributedCoordinator needs torch.distributed.init_process_group() first")
        self._dist = dist
        self._timeout = timeout
        self._ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self._group = self._new_gloo_group()
        self._rank = dist.get_rank(self._group)
        self._start_counting()

    def _start_counting(self) -> None:
        self._rounds = 0
        self._capacity = _FIRST_CAPACITY
        self._longest: tuple[int, ...] = ()

    def _new_gloo_group(self, timeout: timedelta | None = None) -> Any:
        subset = len(self._ranks) != self._dist.get_world_size()
        return self._dist.new_group(
            ranks=self._ranks, timeout=timeout or self._timeout, backend="gloo", use_local_synchronization=subset
        )

    def new_group(self, timeout: timedelta | None = None) -> Any:
        """A new gloo process group over the same ranks (collective), whose operations fail after
        ``timeout`` (default: the coordinator's); for point-to-point messages of one's own
        (:class:`~tiered_ckpt.tiers.peer.link.PeerLink`)."""
        return self._new_gloo_group(timeout)

    def __repr__(self) -> str:
        return f"TorchDistributedCoordinator(rank={self._rank}, world_size={len(self._ranks)})"

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self._rank

    @property
    def world_size(self) -> int:
        return len(self._ranks)

    @property
    def local_ranks(self) -> Sequence[int]:
        return (self._rank,)

    @property
    def is_leader(self) -> bool:
        return self._rank == 0

    def barrier(self) -> None:
        with self._collective("barrier"):
            self._rounds += 1
            self._dist.barrier(group=self._group)

    def all_gather(self, payload: Any) -> list[Any]:
        with self._collective("all_gather"):
            gathered = self._all_gather_bytes(json.dumps(payload).encode())
        return decode_gathered(gathered)

    @contextmanager
    def _collective(self, name: str) -> Iterator[None]:
        try:
            yield
        except Exception as exc:  # the backend's own types (DistBackendError, RuntimeError) vary
            raise CoordinationError(
                f"rank {self._rank}: {name} over {len(self._ranks)} ranks failed "
                f"(a collective with the other ranks failed: a rank died or timed out): {exc}"
            ) from exc

    def broadcast(self, payload: Any) -> Any:
        # Payloads are a few KB: one gather round (the others send null) costs about what a
        # broadcast of a buffer of the channel's capacity would, and is less code.
        return self.all_gather(payload if self.is_leader else None)[0]

    def broadcast_array(self, array: np.ndarray, source: int) -> None:
        import torch

        if array.nbytes == 0:
            return
        data = torch.from_numpy(array.reshape(-1).view(np.uint8))
        with self._collective("broadcast_array"):
            self._rounds += 1
            self._dist.broadcast(data, group=self._group, group_src=source)

    def new_channel(self) -> TorchDistributedCoordinator:
        channel = object.__new__(TorchDistributedCoordinator)
        channel._dist, channel._timeout, channel._ranks = self._dist, self._timeout, self._ranks
        channel._group = self._new_gloo_group()
        channel._rank = self._rank
        channel._start_counting()
        return channel

    @property
    def rounds(self) -> int:
        """How many rounds this coordinator (not its channels) has run, each a round every
        process of the group waits for: a barrier, a broadcast of an array, or a gather round
        (a backend gather to the leader and its broadcast of everything it received)."""
        return self._rounds

    def _all_gather_bytes(self, data: bytes) -> list[bytes]:
        # all_gather_object would pickle. gloo gathers only equal sizes, so each process sends
        # its length and its bytes padded to the channel's capacity: one round for a payload
        # that fits, a second for the rest of one that does not. Every process sees the same
        # lengths, so every process picks the same capacity for the next gather.
        import torch

        size, capacity = len(self._ranks), self._capacity
        sent = np.zeros(_LENGTH_BYTES + capacity, dtype=np.uint8)
        sent[:_LENGTH_BYTES] = np.frombuffer(len(data).to_bytes(_LENGTH_BYTES, "little"), dtype=np.uint8)
        head = np.frombuffer(data, dtype=np.uint8, count=min(len(data), capacity))
        sent[_LENGTH_BYTES : _LENGTH_BYTES + len(head)] = head
        received = self._gather_round(torch.from_numpy(sent), size)
        lengths = [int.from_bytes(chunk[:_LENGTH_BYTES].tobytes(), "little") for chunk in received]
        parts = [
            chunk[_LENGTH_BYTES : _LENGTH_BYTES + min(n, capacity)].tobytes()
            for chunk, n in zip(received, lengths, strict=True)
        ]
        longest = max(lengths)
        if longest > capacity:
            rest = np.zeros(longest - capacity, dtype=np.uint8)
            tail = np.frombuffer(data, dtype=np.uint8)[capacity:]
            rest[: len(tail)] = tail
            more = self._gather_round(torch.from_numpy(rest), size)
            parts = [
                part + chunk[: max(0, n - capacity)].tobytes()
                for part, chunk, n in zip(parts, more, lengths, strict=True)
            ]
        self._longest = (*self._longest[1 - _CAPACITY_MEMORY :], longest)
        self._capacity = max(_LEAST_CAPACITY, 1 << (max(self._longest) - 1).bit_length())
        return parts

    def _gather_round(self, tensor: Any, size: int) -> list[np.ndarray]:
        # gloo's all_gather passes the payloads around a ring, a hop per process, so its
        # latency grows with the number of processes; a gather to the leader and a broadcast
        # of all it received take two steps whatever that number, for the same result.
        import torch

        received = torch.empty(size * tensor.numel(), dtype=tensor.dtype)
        parts = list(received.chunk(size))
        self._rounds += 1
        self._dist.gather(tensor, parts if self.is_leader else None, group=self._group, group_dst=0)
        self._dist.broadcast(received, group=self._group, group_src=0)
        return [part.numpy() for part in parts]


# A gather's first round carries payloads up to the capacity: _FIRST_CAPACITY on a new
# channel, then the longest of its last _CAPACITY_MEMORY gathers (a save's calls alternate
# between short and longer ones) rounded up to a power of two, at least _LEAST_CAPACITY.
# Every process receives capacity bytes from each: a floor far above the payloads would
# cost thousands of ranks more bytes than the round it saves.
_LENGTH_BYTES = 8
_FIRST_CAPACITY = 4096
_LEAST_CAPACITY = 1024
_CAPACITY_MEMORY = 8


def resolve_coordinator(coordinator: Coordinator | None, world_size: int | None) -> Coordinator:
    """The coordinator a manager uses: ``coordinator``, or one process holding ``world_size`` ranks.

    Raises :class:`UsageError` if neither is given, or if they disagree on the world size,
    and :class:`ConfigError` for a ``world_size`` that is not an integer >= 1.
    """
    if coordinator is None:
        if world_size is None:
            raise UsageError(
                "world_size is required when no coordinator is given "
                "(e.g. CheckpointManager(dir, world_size=4), or coordinator=TorchDistributedCoordinator())"
            )
        try:
            return SingleProcessCoordinator(world_size)
        except ConfigError as exc:  # named as the caller wrote it
            error = ConfigError(f"keyword argument {exc}")
            error.field, error.problem = exc.field, exc.problem
            raise error from None
    if world_size is not None and coordinator.world_size != world_size:
        raise UsageError(f"world_size is {world_size} but the coordinator has {coordinator.world_size}")
    return coordinator


@dataclass(frozen=True)
class Done:
    """The payload of a collective that shares nothing but its success."""


@dataclass(frozen=True)
class Attempt(Generic[T]):
    """What running an action on this process gave: its ``result``, or the ``error`` it raised.

    For a collective whose action's result stays on this process (arrays, open files): run it
    with :meth:`run`, hand :meth:`done` (or a function of :attr:`value` making the shared
    payload) to :func:`gather` as its action, and read :attr:`value` once that returned. The
    error is then raised inside the collective, so every process raises it together.
    """

    result: T | None = None
    error: Exception | None = None

    @classmethod
    def run(cls, action: Callable[[], T]) -> Attempt[T]:
        """Run ``action``, keeping its result or the :class:`Exception` it raised (never raised here)."""
        try:
            return cls(action())
        except Exception as exc:
            return cls(None, exc)

    @property
    def value(self) -> T:
        """The result; raises the action's error if it failed."""
        if self.error is not None:
            raise self.error
        return self.result  # type: ignore[return-value]  # T itself may include None

    def done(self) -> Done:
        """:class:`Done` if the action succeeded; raises its error otherwise."""
        _ = self.value
        return Done()


def gather(coordinator: Coordinator, label: str, payload_type: type[P], action: Callable[[], P]) -> list[P]:
    """The collective ``label``: run ``action`` on every process; return every process's payload, in rank order.

    ``action`` returns a ``payload_type``: a frozen dataclass of JSON fields (tuples for
    sequences), rebuilt as one on every process. If ``action`` fails on any process, every
    process raises: the failing one its own exception, the others one error naming that rank
    and ``label`` (the same class of the error tree with its fields and ``rank`` set, or a
    :class:`~tiered_ckpt.RankFailedError` for an exception not of the tree); a collective the backend cannot complete (a rank died or timed out) raises a
    :class:`CoordinationError` naming ``label``. So no process goes on to a collective that
    the others will never join.
    """
    document, failure = _outcome(payload_type, action, label)
    gathered = _labelled(label, coordinator.all_gather, document)
    if failure is not None:
        raise failure
    for rank, item in enumerate(gathered):
        if "error" in item:
            raise _error_from(item["error"], rank, label)
    with cyclic_gc_paused():  # one payload per rank, all alive until returned: see io/gc_pause.py
        return [from_payload(payload_type, item["result"]) for item in gathered]


def decode_gathered(gathered: Sequence[bytes]) -> list[Any]:
    """The JSON values of a gather's payloads, one per process, in rank order."""
    with cyclic_gc_paused():  # one per rank, all alive until returned: see io/gc_pause.py
        return [json.loads(data) for data in gathered]


def _outcome(payload_type: type[P], action: Callable[[], P], label: str) -> tuple[dict[str, Any], Exception | None]:
    """What this process sends in a collective: ``action``'s payload, or, if it failed, its error
    described (and the error itself, which the process raises once the collective is done)."""
    try:
        return {"result": to_payload(_checked(payload_type, action(), label))}, None
    except Exception as exc:
        return {"error": _describe_error(exc)}, exc


def leader_decides(coordinator: Coordinator, label: str, payload_type: type[P], action: Callable[[], P]) -> P:
    """The collective ``label``: run ``action`` on the leader only; return its ``payload_type`` on every process.

    Fails on every process if it fails on the leader (as :func:`gather` does).
    """
    document, failure = _outcome(payload_type, action, label) if coordinator.is_leader else (None, None)
    decision = _labelled(label, coordinator.broadcast, document)
    if failure is not None:
        raise failure
    if "error" in decision:
        raise _error_from(decision["error"], 0, label)
    return from_payload(payload_type, decision["result"])


def _checked(payload_type: type[P], payload: Any, label: str) -> P:
    if type(payload) is not payload_type:  # a bug of the call site: say so on every rank
        returned, wanted = type(payload).__name__, payload_type.__name__
        raise TypeError(f'collective "{label}": the action returned {returned}, not {wanted}')
    return payload


def _labelled(label: str, collective: Callable[[Any], T], document: Any) -> T:
    try:
        return collective(document)
    except CoordinationError as exc:
        found = re.match(r"rank (\d+): ", str(exc))
        rank = int(found.group(1)) if found else None
        raise errors.restated(exc, _named(str(exc), rank, label)) from exc


def _named(message: str, rank: int | None, label: str) -> str:
    """``message`` as 'rank 3 (during "commit"): ...', naming the rank once (None: unknown)."""
    if rank is None:
        return f'during "{label}": {message}'
    return f'rank {rank} (during "{label}"): {message.removeprefix(f"rank {rank}: ")}'


def to_payload(payload: Any) -> Any:
    """A frozen dataclass of JSON fields as the JSON value a collective carries."""
    return dataclasses.asdict(payload)


def _as_tuples(value: Any) -> Any:
    return tuple(_as_tuples(item) for item in value) if isinstance(value, list) else value


def from_payload(payload_type: type[P], document: Any) -> P:
    """The dataclass :func:`to_payload` made ``document`` from (sequences come back as tuples)."""
    fields = dataclasses.fields(payload_type)  # type: ignore[arg-type]
    return payload_type(**{field.name: _as_tuples(document[field.name]) for field in fields})


_ERROR_ATTRIBUTES = ("step", "tries", "transient", "deadline", "exhausted", "field", "problem")


def _describe_error(exc: BaseException) -> dict[str, Any]:
    """``exc`` as a collective carries it: its class of the error tree (None for any other
    exception), its class name, its message and the fields of the tree that it holds."""
    ours = isinstance(exc, CheckpointError) and errors.TREE.get(type(exc).__name__) is type(exc)
    return {
        "type": type(exc).__name__ if ours else None,
        # one passed on from another rank keeps its origin's class name and message
        "kind": exc.kind if isinstance(exc, errors.RankFailedError) else type(exc).__name__,
        "message": exc.message if isinstance(exc, errors.RankFailedError) else str(exc),
        "attributes": {name: getattr(exc, name) for name in _ERROR_ATTRIBUTES if hasattr(exc, name)},
    }


def _error_from(description: dict[str, Any], rank: int, label: str) -> CheckpointError:
    """Rank ``rank``'s error described by :func:`_describe_error`, to raise here: the same class of
    the tree with the same fields and ``rank`` set, or a :class:`~tiered_ckpt.RankFailedError`."""
    name, message = description.get("type"), str(description.get("message"))
    error_type = errors.TREE.get(name) if isinstance(name, str) else None
    if error_type is None or error_type is errors.RankFailedError:
        return errors.RankFailedError(message, rank=rank, kind=str(description.get("kind")), during=label)
    template = error_type.__new__(error_type)
    template.__dict__.update(
        {name: value for name, value in dict(description.get("attributes") or {}).items() if name in _ERROR_ATTRIBUTES}
    )
    error = errors.restated(template, _named(message, rank, label))
    error.rank = rank
    return error
