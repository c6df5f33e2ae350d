"""Run identities on the bucket: which runs are writing under a remote URL right now.

A manager's uploader holds a *lease* on its remote URL: an owner record,
``<url>/owners/<run id>.json`` (strict JSON, no pickle), written before the uploader
cleans anything at start-up, rewritten every ``lease_seconds / 4`` by a thread of its
own while the run lives, and deleted on close. The run id is random per manager (the
leader's, for every process of a job: one record per job).

A record is **live** until ``lease_seconds`` (its writer's, as recorded) have passed
since it was last renewed, and **dead** after; it is also dead at once when it names a
process of this machine (the same boot, the same PID namespace) that no longer runs, so
a job killed and restarted on the same node does not wait out its own lease. A record
that does not parse counts as live (and is named in a WARNING): deleting a live run's
upload is the one mistake clean-up must never make.

What the leases decide (see :class:`~tiered_ckpt.engine.replication.Replicator`):

- start-up clean-up deletes half-uploaded steps and aborts open multipart uploads only
  while no other run's record is live; multipart uploads also only once started
  ``orphan_age_seconds`` ago (default one hour);
- remote retention deletes nothing while another run's record is live;
- with another live run, ``other_owners="warn"`` (the default) logs a WARNING naming it
  and goes on; ``"refuse"`` raises :class:`~tiered_ckpt.errors.RemoteInUseError`.

Why ``"warn"`` by default: a job killed on one node and restarted on another within
``lease_seconds`` finds its own previous run's record live, and refusing would keep an
elastic restart from starting for minutes. Sharing a URL loses nothing already in the
bucket: nothing of a live run is deleted or aborted, remote manifests are create-only
(atomically on S3, GCS, Azure and file systems), and every object is confirmed again right
before a commit, so a commit over a missing or replaced object is never written. What
sharing cannot prevent is two live runs writing the same step's objects, so that one of
them fails its upload: set ``other_owners="refuse"`` where that must not happen (e.g. the runs of a sweep).

Clocks: ``renewed_at`` is the writer's clock, compared with the reader's; hosts sharing
a bucket must keep their clocks within a small part of ``lease_seconds`` (NTP does).
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

from tiered_ckpt.errors import CheckpointError, ManifestError, RemoteError, RemoteInUseError, invalid_option
from tiered_ckpt.format.bounds import MAX_SECONDS, check_number
from tiered_ckpt.tiers.remote.upkeep import MAX_OWNER_BYTES

__all__ = ["OwnershipPolicy", "OwnerRecord", "OwnerRecords", "Lease", "OtherOwners", "live_owners", "OWNER_KIND"]

logger = logging.getLogger("tiered_ckpt")

OWNER_KIND = "tiered_ckpt.owner/1"
OtherOwners = Literal["warn", "refuse"]


class OwnerRecords(Protocol):
    """Where leases are kept: the owner records under one URL (the object-store tier's; see
    :class:`~tiered_ckpt.tiers.remote.upkeep.BucketUpkeep`)."""

    url: str

    def owner_location(self, run_id: str) -> str: ...

    def write_owner(self, run_id: str, document: bytes) -> None: ...

    def read_owners(self, besides: str | None = None) -> dict[str, bytes]: ...

    def delete_owner(self, run_id: str) -> None: ...


@dataclass(frozen=True)
class OwnershipPolicy:
    """How a run holds its remote URL (see the module doc): its lease lasts ``lease_seconds``
    unrenewed (renewed every quarter of it), multipart uploads left open are aborted only
    once ``orphan_age_seconds`` old, and ``other_owners`` says what another live run means."""

    lease_seconds: float = 300.0
    orphan_age_seconds: float = 3600.0
    other_owners: OtherOwners = "warn"

    def __post_init__(self) -> None:
        check_number("lease_seconds", self.lease_seconds, 1, MAX_SECONDS, (int, float))
        check_number("orphan_age_seconds", self.orphan_age_seconds, 0, MAX_SECONDS, (int, float))
        if self.other_owners not in ("warn", "refuse"):
            raise invalid_option("other_owners", f"must be one of ['refuse', 'warn'], got {self.other_owners!r:.60}")


def _read(path: str) -> str:
    try:
        with open(path) as source:
            return source.read()
    except OSError:
        return ""


def _machine() -> str:
    """This process's boot and PID namespace ("" where /proc does not tell): two records with
    the same one name processes whose PIDs can be looked up here."""
    boot = _read("/proc/sys/kernel/random/boot_id").strip()
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{boot}/{namespace}" if boot else ""


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot); "" if it does not run (a zombie
    does not run); None if this process may not know (``/proc`` hides it, yet it exists)."""
    stat = _read(f"/proc/{pid}/stat")
    fields = stat.rpartition(")")[2].split()
    if len(fields) >= 20:
        return "" if fields[0] == "Z" else fields[19]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return ""
    except OSError:  # PermissionError: it exists, owned by someone else
        return None
    return None


@dataclass(frozen=True)
class OwnerRecord:
    """One run's owner record: who (``run_id``, ``host``, ``pid``; ``machine`` and
    ``process_start`` tell whether that process still runs, on its own machine), since when
    (``started_at``) and how long it counts unrenewed (``renewed_at`` + ``ttl_seconds``; Unix times)."""

    run_id: str
    host: str
    pid: int
    machine: str
    process_start: str
    started_at: float
    renewed_at: float
    ttl_seconds: float

    def to_json(self) -> str:
        return json.dumps({"kind": OWNER_KIND, **asdict(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, data: bytes, source: str) -> OwnerRecord:
        """Parse a record strictly; :class:`ManifestError` naming ``source`` and the field if it is not one."""
        if len(data) > MAX_OWNER_BYTES:
            raise ManifestError(f"{source}: over {MAX_OWNER_BYTES} bytes, not an owner record")
        try:
            document = json.loads(data.decode("utf-8"), parse_constant=lambda name: float("nan"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ManifestError(f"{source}: not JSON: {exc}") from None
        if not isinstance(document, dict) or document.get("kind") != OWNER_KIND:
            raise ManifestError(f"{source}: field 'kind': expected {OWNER_KIND!r}")
        types = {"run_id": str, "host": str, "pid": int, "machine": str, "process_start": str}
        types |= {"started_at": float, "renewed_at": float, "ttl_seconds": float}
        unknown = sorted(set(document) - set(types) - {"kind"})
        if unknown:
            raise ManifestError(f"{source}: unknown fields {unknown[:5]}")
        values: dict[str, Any] = {}
        for name, kind in types.items():
            value: Any = document.get(name)  # checked next
            number = kind is float and isinstance(value, int) and not isinstance(value, bool)
            if not (isinstance(value, kind) and not isinstance(value, bool)) and not number:
                raise ManifestError(f"{source}: field {name!r}: expected {kind.__name__}, got {value!r:.60}")
            if kind is float and not abs(value) <= sys.float_info.max:  # nan, infinity, an int no float holds
                raise ManifestError(f"{source}: field {name!r}: expected a finite number, got {value!r}")
            values[name] = float(value) if kind is float else value
        return cls(**values)

    def live(self, now: float) -> bool:
        """True until ``ttl_seconds`` have passed since ``renewed_at`` at ``now``, unless the record
        names a process of this machine that no longer runs."""
        if now - self.renewed_at > self.ttl_seconds:
            return False
        if self.machine and self.machine == _machine():
            start = _process_start(self.pid)
            return start is None or start == self.process_start  # another start: the PID was reused
        return True

    def describe(self, now: float) -> str:
        return (
            f"run {self.run_id} (host {self.host}, pid {self.pid}, renewed {max(0.0, now - self.renewed_at):.0f} s "
            f"ago, lease {self.ttl_seconds:g} s)"
        )


def live_owners(
    remote: OwnerRecords, now: float, *, besides: str | None = None, remove_dead: bool = False
) -> list[OwnerRecord]:
    """The runs whose records under ``remote``'s URL are live at ``now`` (besides run ``besides``);
    with ``remove_dead``, the records of dead runs are deleted on the way (a run that comes
    back writes its record again at its next renewal).

    A record that does not parse counts as live (logged at WARNING; see the module doc).
    """
    found = []
    for run_id, data in sorted(remote.read_owners(besides).items()):
        location = remote.owner_location(run_id)
        try:
            record = OwnerRecord.from_json(data, location)
        except ManifestError as exc:
            logger.warning("%s; counted as a live run until it is removed", exc)
            record = OwnerRecord(run_id, "?", 0, "", "", now, now, math.inf)
        if record.live(now):
            found.append(record)
        elif remove_dead:
            logger.info("removing the lease of %s: it is dead", record.describe(now))
            remote.delete_owner(run_id)
    return found


class Lease:
    """This run's owner record under ``remote``'s URL (see the module doc).

    :meth:`hold` writes it and starts renewing it; :meth:`release` stops that and deletes
    it. ``clock`` gives Unix times (tests pass their own). Renewal failures are logged
    (WARNING) and tried again at the next interval: they never fail the job.
    """

    def __init__(
        self,
        remote: OwnerRecords,
        policy: OwnershipPolicy | None = None,
        *,
        clock: Callable[[], float] = time.time,
        run_id: str | None = None,
    ) -> None:
        self._remote = remote
        self.policy = policy or OwnershipPolicy()
        self._clock = clock
        self.run_id = run_id or secrets.token_hex(8)
        self._started_at: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"Lease({self._remote.url!r}, run_id={self.run_id!r})"

    @property
    def held(self) -> bool:
        return self._started_at is not None and not self._stop.is_set()

    def _record(self) -> OwnerRecord:
        assert self._started_at is not None
        machine = _machine()
        return OwnerRecord(
            run_id=self.run_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            machine=machine,
            process_start=(_process_start(os.getpid()) or "") if machine else "",
            started_at=self._started_at,
            renewed_at=self._clock(),
            ttl_seconds=float(self.policy.lease_seconds),
        )

    def hold(self) -> list[OwnerRecord] | None:
        """Write this run's record (first call: and start renewing it); return the other live runs,
        or None if they cannot be read now (then nothing may be cleaned up).

        With another live run, logs a WARNING naming each one, or raises
        :class:`RemoteInUseError` if the policy says ``other_owners="refuse"``. The bucket
        failing a request never fails this call (the job outlives its bucket): a record not
        written is logged and written by the next renewal; records that cannot be read are
        logged and answer None (with ``"refuse"``, that error is raised).
        """
        if self._started_at is None:
            self._started_at = self._clock()
            try:
                self.renew()
            except RemoteError as exc:
                logger.warning("could not write %s (tried again in %g s): %s", self, self.policy.lease_seconds / 4, exc)
            self._thread = threading.Thread(target=self._renew_until_released, name="tiered-ckpt-lease", daemon=True)
            self._thread.start()
        try:
            others = live_owners(self._remote, self._clock(), besides=self.run_id, remove_dead=True)
        except RemoteError as exc:
            if self.policy.other_owners == "refuse":
                raise
            logger.warning(
                "could not read the other runs' leases under %s: nothing is cleaned up: %s", self._remote.url, exc
            )
            return None
        if others:
            now = self._clock()
            names = "; ".join(other.describe(now) for other in others)
            message = (
                f"{self._remote.url} is also written by another live run: {names}. Nothing of theirs is deleted "
                f"or aborted while their lease lasts; two runs writing the same step make one of them fail its upload"
            )
            if self.policy.other_owners == "refuse":
                raise RemoteInUseError(f"{message} (remote other_owners='refuse'; this run is {self.run_id})")
            logger.warning("%s (this run is %s; other_owners='refuse' makes this an error)", message, self.run_id)
        return others

    def others(self) -> list[OwnerRecord]:
        """The other runs whose records are live now."""
        return live_owners(self._remote, self._clock(), besides=self.run_id)

    def renew(self) -> None:
        """Write this run's record with the clock's time (nothing after :meth:`release`)."""
        with self._lock:
            if self._stop.is_set():
                return
            self._remote.write_owner(self.run_id, self._record().to_json().encode())

    def _renew_until_released(self) -> None:
        while not self._stop.wait(self.policy.lease_seconds / 4):
            try:
                self.renew()
            except CheckpointError as exc:
                logger.warning("could not renew %s (tried again in %g s): %s", self, self.policy.lease_seconds / 4, exc)

    def release(self) -> None:
        """Stop renewing and delete this run's record (a failure is logged: the record then
        expires after ``lease_seconds``)."""
        if self._started_at is None or self._stop.is_set():
            self._stop.set()
            return
        with self._lock:
            self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self._remote.delete_owner(self.run_id)
        except CheckpointError as exc:
            logger.warning("could not delete %s's record (it expires unrenewed): %s", self, exc)
