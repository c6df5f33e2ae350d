"""``CheckpointManager``: the object a training job holds for the whole run.

A save, step by step (see DESIGN.md section 6):

1. raise any background error not yet raised; wait for the previous save's write;
2. stage: copy every array into host buffers reused from save to save (the only
   time the training loop is blocked);
3. in the background writer thread: write each rank's shard to a temp file,
   hashing as it streams, fsync, rename; commit the manifest last;
4. apply retention: make older steps invisible (manifest first), then delete them.

A restore picks the newest committed step (or the one asked for), verifies every
shard before returning it, and reshards to another world size only when asked.

With one process per rank (a :class:`~tiered_ckpt.TorchDistributedCoordinator`), each
process saves and restores its own rank into a local directory of its own, and the
processes agree at each point where one rank's view is not enough:

- save: the step and the arrays' shapes are checked on every rank before staging (a bad
  call raises on every rank); each rank writes its shard; the manifest is committed in
  each rank's directory only once every rank's shard is durable (a failure anywhere
  fails the save everywhere);
- upload: each rank uploads its own shard; the leader commits the remote manifest only
  once every rank's shard is confirmed in the bucket;
- restore: every rank reports its committed steps, the leader picks the newest step
  that every rank holds locally or the bucket holds, and each rank then reads its shard
  from its own disk or, if missing or damaged, from the bucket.

These collectives run on the caller's thread (the checks of save and restore) and on
the writer and uploader threads, each on a process group of its own (see
:mod:`tiered_ckpt.coordination`), so they never meet the training loop's collectives.
Every rank must make the same calls in the same order, as with any collective.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar, overload

import numpy as np

from .config import Config, load_config
from .coordination import Coordinator, SingleProcessCoordinator, agree, leader_decides
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    ChecksumMismatchError,
    DirectoryInUseError,
    IncompleteCheckpointError,
    InvalidStateError,
    ManifestError,
    RemoteError,
    SaveError,
    ShardFormatError,
    UploadError,
    restated,
)
from .layout import step_dir_name
from .local import (
    check_shard_file,
    commit_manifest,
    committed_steps,
    delete_checkpoint,
    directory_lock,
    fsync_directory,
    held_ranks,
    is_committed,
    read_manifest,
    read_shard_file,
    record_held_ranks,
    remove_uncommitted,
)
from .manifest import SCHEMA_VERSION, RemoteManifest, ShardManifest, ShardRecord
from .remote import RemoteTier
from .reshard import reshard as reshard_states
from .reshard import reshard_rank, source_ranks
from .sharded import (
    check_into,
    check_world_size,
    resolve_sharded_keys,
    run_parallel,
    sharding_summary,
    validate_states,
    validate_step,
    write_shards,
)
from .shardfile import Verify, check_arrays
from .tensors import numpy_state, torch_state
from .uploader import Uploader, WhenBehind, read_receipt, write_receipt

__all__ = ["CheckpointManager", "SaveHandle", "RestoreResult", "StagingBuffers"]

logger = logging.getLogger("tiered_ckpt")

State = Mapping[str, np.ndarray]
T = TypeVar("T")


BACKGROUND_NICENESS = 10


def _lower_thread_priority() -> None:
    """Let the training loop's threads win the CPU over the background writer.

    On Linux the nice value is per thread, and threads the writer starts inherit it.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at normal priority
        logger.debug("could not lower the background writer's priority", exc_info=True)


class StagingBuffers:
    """Host buffers that hold a copy of every rank's arrays between a save call and its write.

    A buffer is reused from save to save and reallocated only when its array's dtype or
    shape changes; arrays that are no longer saved are released.
    """

    def __init__(self) -> None:
        self._buffers: list[dict[str, np.ndarray]] = []

    def stage(self, states: Sequence[State]) -> list[dict[str, np.ndarray]]:
        """Copy ``states`` into the buffers and return the buffers (C-contiguous copies)."""
        staged = []
        for rank, state in enumerate(states):
            previous = self._buffers[rank] if rank < len(self._buffers) else {}
            buffers = {}
            for key, array in check_arrays(state, f"rank {rank}").items():
                buffer = previous.get(key)
                if buffer is None or buffer.dtype != array.dtype or buffer.shape != array.shape:
                    buffer = np.empty(array.shape, dtype=array.dtype)
                np.copyto(buffer, array, casting="no")
                buffers[key] = buffer
            staged.append(buffers)
        self._buffers = staged
        return staged

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(buffer.nbytes for buffers in self._buffers for buffer in buffers.values())


class SaveHandle:
    """The pending result of one :meth:`CheckpointManager.save`."""

    def __init__(self, step: int, future: Future[ShardManifest], owner: CheckpointManager) -> None:
        self.step = step
        self._future = future
        self._owner = owner

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "pending"
        return f"SaveHandle(step={self.step}, {state})"

    def done(self) -> bool:
        """True once the save has committed or failed."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> ShardManifest:
        """Block until the checkpoint is committed locally and return its manifest.

        Raises :class:`SaveError` (cause chained) if the save failed; an error raised
        here is not raised again by the manager's next call.
        """
        try:
            return self._future.result(timeout)
        except SaveError as error:
            self._owner._mark_raised(error)
            raise

    @property
    def manifest(self) -> ShardManifest | None:
        """The committed manifest, or None while the save is running or if it failed."""
        if self._future.done() and self._future.exception() is None:
            return self._future.result()
        return None


@dataclass(frozen=True)
class RestoreResult:
    """What :meth:`CheckpointManager.restore` returns.

    ``states[i]`` is the dict of arrays of rank ``ranks[i]``: every rank when one process
    holds them all, this process's rank under a multi-process coordinator. ``sources``
    maps each shard this process read (by the rank that saved it) to the tier it was
    read from: ``"local"`` or ``"remote"``.
    """

    step: int
    states: list[dict[str, np.ndarray]]
    sources: dict[int, str]
    ranks: tuple[int, ...]
    manifest: ShardManifest = field(repr=False)

    @property
    def state(self) -> dict[str, np.ndarray]:
        """The one rank's arrays, when this process holds one rank (one process per rank)."""
        if len(self.states) != 1:
            raise InvalidStateError(f"this result holds {len(self.states)} ranks; use .states")
        return self.states[0]

    def torch_states(self) -> list[dict[str, Any]]:
        """``states`` as CPU torch tensors sharing the arrays' memory (needs torch)."""
        return [torch_state(state) for state in self.states]

    def torch_state(self) -> dict[str, Any]:
        """:attr:`state` as CPU torch tensors sharing the arrays' memory (needs torch)."""
        return torch_state(self.state)


class CheckpointManager:
    """Saves, retains and restores the checkpoints of one training job in ``local_dir``.

    ``world_size`` ranks are saved per step, each into its own shard. By default one
    process holds them all; with ``coordinator=TorchDistributedCoordinator()`` each
    process holds its own rank (``world_size`` then defaults to the coordinator's), and
    ``local_dir`` must be this process's own directory (one per rank, e.g. on the node's
    local disk; two processes cannot share one). ``keep_last``
    keeps the newest steps (None keeps all), ``keep_every`` also keeps every step
    divisible by it; the newest committed step is never deleted. ``sharded_keys``
    names the flat-parameter slices (default: the arrays 1-D on every rank, see
    :func:`~tiered_ckpt.save_sharded`). Starting a manager removes what crashed saves
    left in ``local_dir``; two managers cannot hold one directory at once
    (:class:`DirectoryInUseError`).

    Use it as a context manager, or call :meth:`close` at the end of the run.
    """

    def __init__(
        self,
        local_dir: str | os.PathLike[str],
        *,
        world_size: int | None = None,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        remote_url: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        keep_last_remote: int | None = None,
        keep_every_remote: int | None = None,
        coordinator: Coordinator | None = None,
        sharded_keys: Iterable[str] | None = None,
        max_workers: int | None = None,
        verify: Verify = "full",
        upload_concurrency: int = 2,
        upload_max_tries: int = 5,
        upload_backoff_seconds: float = 0.5,
        max_pending_uploads: int = 2,
        when_uploads_behind: WhenBehind = "wait",
    ) -> None:
        for name, value in [
            ("keep_last", keep_last),
            ("keep_every", keep_every),
            ("keep_last_remote", keep_last_remote),
            ("keep_every_remote", keep_every_remote),
        ]:
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}")
        if verify not in ("full", "fast"):
            raise ValueError(f"verify must be 'full' or 'fast', got {verify!r}")
        if coordinator is None:
            if world_size is None:
                raise ValueError("world_size is required when no coordinator is given")
            coordinator = SingleProcessCoordinator(world_size)
        world_size = coordinator.world_size if world_size is None else world_size
        if coordinator.world_size != world_size:
            raise ValueError(f"world_size is {world_size} but the coordinator has {coordinator.world_size}")
        self._coordinator = coordinator
        self._ranks = tuple(coordinator.local_ranks)
        if len(self._ranks) != world_size and when_uploads_behind == "skip":
            raise ValueError(
                "when_uploads_behind='skip' needs one process holding every rank: "
                "with one process per rank, ranks could skip different steps"
            )
        self.world_size = world_size
        self.root = Path(local_dir)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.keep_last_remote, self.keep_every_remote = keep_last_remote, keep_every_remote
        self.verify: Verify = verify
        self._sharded_keys = tuple(sharded_keys) if sharded_keys is not None else None
        self._max_workers = max_workers
        self._staging = StagingBuffers()
        self._last_save: SaveHandle | None = None
        self._errors: list[SaveError] = []  # failed background saves not yet raised
        self._errors_lock = threading.Lock()
        self._upload_errors_raised: set[int] = set()  # steps whose UploadError was raised on this rank
        self._retention_lock = threading.Lock()
        self._closed = False
        self._remote = RemoteTier(remote_url, storage_options) if remote_url is not None else None
        self._uploader: Uploader | None = None
        self._newest_remote: int | None = None

        self._exit_stack = ExitStack()
        try:
            agree(self._coordinator, self._open_local_dir)
            if self._remote is not None:
                self._uploader = Uploader(
                    self.root,
                    self._remote,
                    coordinator=self._coordinator.new_channel(),
                    ranks=self._ranks,
                    on_committed=self._after_remote_commit,
                    concurrency=upload_concurrency,
                    max_tries=upload_max_tries,
                    backoff_seconds=upload_backoff_seconds,
                    max_pending=max_pending_uploads,
                    when_behind=when_uploads_behind,
                )
                self._exit_stack.callback(self._uploader.close)
                self._resume_uploads()
        except BaseException:
            self._exit_stack.close()  # release the directory and stop the uploader: nothing is half-open
            raise
        self._writer = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tiered-ckpt-writer", initializer=_lower_thread_priority
        )

    def _open_local_dir(self) -> None:
        """Lock the local directory and remove what crashed saves left in it."""
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            self._exit_stack.enter_context(directory_lock(self.root))
        except DirectoryInUseError as exc:
            if self._one_process:
                raise
            raise DirectoryInUseError(
                f"{exc}; with one process per rank, give each rank a local_dir of its own"
            ) from exc
        removed = remove_uncommitted(self.root)
        if removed:
            logger.warning("removed what crashed saves left in %s: %s", self.root, ", ".join(removed))

    @property
    def _one_process(self) -> bool:
        return len(self._ranks) == self.world_size

    @classmethod
    def from_config(
        cls,
        config: Config | str | os.PathLike[str],
        *,
        world_size: int | None = None,
        local_dir: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> CheckpointManager:
        """A manager as a config file (or a loaded :class:`Config`) describes it.

        ``local_dir`` (e.g. one directory per rank under the config's) and ``kwargs``,
        :class:`CheckpointManager` arguments such as ``coordinator``, override the config
        (explicit argument > environment > file > default).
        """
        if not isinstance(config, Config):
            config = load_config(config)
        arguments = {**config.manager_kwargs(), "verify": config.verify.mode, **kwargs}
        return cls(config.local.dir if local_dir is None else local_dir, world_size=world_size, **arguments)

    def __repr__(self) -> str:
        remote = f", remote_url={self._remote.url!r}" if self._remote is not None else ""
        return (
            f"CheckpointManager({str(self.root)!r}, world_size={self.world_size}, "
            f"keep_last={self.keep_last}, keep_every={self.keep_every}{remote})"
        )

    # -- the remote tier ------------------------------------------------------------------

    def _resume_uploads(self) -> None:
        """Queue local steps a crash kept from their remote commit; drop half-uploaded remote steps.

        A step is resumed only if every rank still holds it; the leader lists and cleans the bucket.
        """
        assert self._remote is not None and self._uploader is not None
        remote, retrying = self._remote, self._uploader.retrying
        listing = leader_decides(
            self._coordinator,
            lambda: {
                "committed": retrying(f"listing {remote.url}", remote.committed_steps),
                "uncommitted": retrying(f"listing {remote.url}", remote.uncommitted_steps),
            },
        )
        remote_steps = listing["committed"]
        self._newest_remote = remote_steps[-1] if remote_steps else None
        mine: list[int] = []

        def report() -> list[int]:
            mine.extend(self._steps_to_resume(remote_steps))
            return mine

        wanted = agree(self._coordinator, report)
        resumed = sorted(set(wanted[0]).intersection(*wanted[1:]))
        for step in sorted(set(mine) - set(resumed)):
            logger.warning("step %d is committed in %s but not on every rank: it cannot be uploaded", step, self.root)
        if self._coordinator.is_leader:
            for step in listing["uncommitted"]:
                if step not in resumed:
                    logger.warning("removing half-uploaded step %d from %s", step, remote.url)
                    retrying(f"deleting {remote.location(step)}", functools.partial(remote.delete_step, step))
        for step in resumed:
            logger.warning("resuming the upload of step %d to %s", step, remote.url)
            self._uploader.submit(step, bounded=False)

    def _steps_to_resume(self, remote_steps: list[int]) -> list[int]:
        """Local steps committed here whose remote commit a crash prevented (receipts mended on the way)."""
        assert self._remote is not None and self._uploader is not None
        remote, retrying = self._remote, self._uploader.retrying
        resumed = []
        for step in committed_steps(self.root):
            directory = self.root / step_dir_name(step)
            if read_receipt(directory, remote.url):
                continue
            if step in remote_steps:  # committed remotely, the receipt lost in a crash
                committed = retrying(f"reading {remote.location(step)}", functools.partial(remote.read_manifest, step))
                if committed.manifest.shards == read_manifest(directory).shards:
                    write_receipt(directory, remote.url, committed)
                    continue
            if self._newest_remote is None or step > self._newest_remote:
                resumed.append(step)
        return resumed

    def _after_remote_commit(self, remote: RemoteManifest) -> None:
        """Uploader thread: a step is committed remotely; apply retention to both tiers."""
        assert self._remote is not None
        assert self._uploader is not None
        self._newest_remote = max(self._newest_remote or 0, remote.manifest.step)
        remote_retention = self.keep_last_remote is not None or self.keep_every_remote is not None
        if remote_retention and self._coordinator.is_leader:
            steps = self._uploader.retrying(f"listing {self._remote.url}", self._remote.committed_steps)
            for step in _to_delete(steps, self.keep_last_remote, self.keep_every_remote):
                self._uploader.retrying(
                    f"deleting {self._remote.location(step)}", functools.partial(self._remote.delete_step, step)
                )
                logger.info("remote retention: deleted step %d from %s", step, self._remote.url)
        self._apply_retention()

    def remote_steps(self) -> list[int]:
        """Steps committed in the remote tier, oldest first (empty without a remote tier)."""
        return self._remote.committed_steps() if self._remote is not None else []

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except CheckpointError:
            # The exception already propagating is the one the caller needs to see.
            logger.exception("error while closing %r during another exception", self)

    # -- saving -------------------------------------------------------------------------

    def save(self, step: int, states: Sequence[State] | State, *, blocking: bool = False) -> SaveHandle:
        """Checkpoint ``states`` (one dict of numpy arrays or torch tensors per rank) as ``step``.

        With one process per rank, ``states`` is this rank's dict (every rank calls
        ``save`` with the same step). Returns once the arrays are copied to staging
        buffers: the caller may then overwrite its arrays. The write runs in the
        background; ``blocking=True`` waits for the commit. Raises first any background
        error not yet raised (:class:`SaveError`), then :class:`InvalidStateError` for
        bad input and :class:`CheckpointExistsError` if ``step`` is not newer than every
        committed step (on every rank, whichever rank's input or directory is at fault).
        """
        self._check_open()
        self._wait_for_last_save()
        local: list[State] = []

        def check() -> dict[str, Any]:
            self._raise_background_error()
            validate_step(step)
            given = [states] if isinstance(states, Mapping) else states
            validate_states(given, len(self._ranks))
            # torch tensors become numpy views; every array is checked here, inside the
            # collective, so a bad array raises on every rank rather than stranding the others
            local.extend(
                check_arrays(numpy_state(state), f"rank {r}") for r, state in zip(self._ranks, given, strict=True)
            )
            shapes = [sharding_summary(state) for state in local]
            return {"arguments": {"step": step}, "newest": self.latest_step(), "shapes": shapes}

        reports = self._agree(check)
        _check_same_call(reports, "save")
        newest = max((report["newest"] for report in reports if report["newest"] is not None), default=None)
        if newest is not None and step <= newest:
            raise CheckpointExistsError(
                f"{self.root}: step {step} is not newer than the newest checkpoint, step {newest}"
            )
        keys, numels = resolve_sharded_keys([shape for r in reports for shape in r["shapes"]], self._sharded_keys)
        staged = self._staging.stage(local)
        future = self._writer.submit(self._write, step, staged, keys, numels)
        handle = SaveHandle(step, future, self)
        self._last_save = handle
        if blocking:
            handle.wait()
        return handle

    def _write(
        self, step: int, staged: list[dict[str, np.ndarray]], keys: tuple[str, ...], numels: list[int]
    ) -> ShardManifest:
        """Background: write this process's shards, commit once every rank's are durable, apply retention."""
        directory = self.root / step_dir_name(step)
        try:

            def write_local() -> dict[str, Any]:
                directory.mkdir(exist_ok=True)
                fsync_directory(self.root)
                records = write_shards(
                    directory,
                    staged,
                    self._ranks,
                    step,
                    world_size=self.world_size,
                    numels=numels,
                    max_workers=self._max_workers,
                )
                return {"shards": [record.to_dict() for record in records], "time": time.time()}

            written = agree(self._coordinator, write_local)
            manifest = ShardManifest.from_dict(
                {
                    "schema_version": SCHEMA_VERSION,
                    "world_size": self.world_size,
                    "step": step,
                    "wall_clock_seconds": written[0]["time"],  # the leader's clock
                    "sharded_keys": list(keys),
                    "shards": [shard for part in written for shard in part["shards"]],
                },
                source=f"the shard records of step {step}",
            )
            record_held_ranks(directory, manifest, self._ranks)  # other ranks' shards are on their nodes
            commit_manifest(directory, manifest)
            logger.info("committed step %d (%d bytes) in %s", step, manifest.total_bytes, directory)
            self._apply_retention()
            if self._uploader is not None:
                self._uploader.submit(step)
            return manifest
        except BaseException as exc:
            self._discard_uncommitted(directory)
            error = SaveError(f"background save of step {step} to {directory} failed: {exc}", step=step)
            error.__cause__ = exc
            with self._errors_lock:
                self._errors.append(error)
            raise error from exc

    def _discard_uncommitted(self, directory: Path) -> None:
        """Free the space a failed save took; its step was never visible."""
        try:
            if directory.is_dir() and not is_committed(directory):
                shutil.rmtree(directory)
        except OSError:
            logger.warning("could not remove %s after a failed save; the next start will", directory, exc_info=True)

    def _apply_retention(self) -> None:
        with self._retention_lock:
            steps = committed_steps(self.root)
            for step in _to_delete(steps, self.keep_last, self.keep_every, protected=self._awaiting_upload(steps)):
                delete_checkpoint(self.root / step_dir_name(step))
                logger.info("retention: deleted step %d from %s", step, self.root)

    def _awaiting_upload(self, steps: list[int]) -> set[int]:
        """Local steps retention must keep: not yet committed remotely, nor superseded there."""
        if self._remote is None or self._uploader is None:
            return set()
        receipted = {step for step in steps if read_receipt(self.root / step_dir_name(step), self._remote.url)}
        newest_receipted = max(receipted, default=-1)
        pending = set(self._uploader.pending())
        return {step for step in steps if step not in receipted and (step in pending or step > newest_receipted)}

    def _wait_for_last_save(self) -> None:
        if self._last_save is not None:
            self._last_save._future.exception()  # waits; the error itself is in self._errors

    def _mark_raised(self, error: SaveError) -> None:
        with self._errors_lock:
            if error in self._errors:
                self._errors.remove(error)

    def _raise_background_error(self) -> None:
        with self._errors_lock:
            error: CheckpointError | None = self._errors.pop(0) if self._errors else None
        while error is None and self._uploader is not None:
            failed_upload = self._uploader.pop_error()
            if failed_upload is None:
                break
            if failed_upload.step not in self._upload_errors_raised:  # else raised already, from another rank
                error = failed_upload
        if error is not None:
            raise error

    def _agree(self, action: Callable[[], T]) -> list[T]:
        """:func:`agree` for the calls every rank makes; background errors are raised there, by every rank.

        A rank's uploader may record a failed upload (agreed by every rank's uploader)
        a moment before or after another's: the rank that has it raises it inside the
        collective, so every rank raises it at the same call, and the others' copies,
        when they arrive, are not raised again.
        """
        try:
            return agree(self._coordinator, action)
        except UploadError as error:
            self._upload_errors_raised.add(error.step)
            raise

    def wait(self, *, uploaded: bool = False) -> None:
        """Block until every save so far is committed locally (and remotely, with ``uploaded=True``).

        Raises a background error not yet raised: :class:`SaveError` or :class:`UploadError`.
        """
        self._wait_for_last_save()
        if uploaded and self._uploader is not None:
            self._uploader.wait()
        self._raise_background_error()

    def close(self) -> None:
        """Finish pending saves, release the directory, and raise a background error not yet raised.

        Calling it again does nothing.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._writer.shutdown(wait=True)
        finally:
            self._exit_stack.close()  # finishes the uploads (LIFO), then releases the directory
        self._raise_background_error()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"{self!r} is closed")

    def _check_single_process(self, operation: str) -> None:
        self._check_open()
        if not self._one_process:
            raise InvalidStateError(
                f"{operation} is a maintenance operation of one process holding every rank (as the CLI runs it); "
                "saves of one process per rank upload and prune by themselves"
            )

    # -- listing and restoring -------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps in the local directory, oldest first."""
        return committed_steps(self.root)

    def latest_step(self) -> int | None:
        """The newest step committed in either tier, or None if there is none.

        With one process per rank this is this rank's view (its own directory and the
        bucket as of its last upload); :meth:`restore` is what makes the ranks agree.
        """
        steps = self.steps()
        candidates = [steps[-1]] if steps else []
        if self._newest_remote is not None:
            candidates.append(self._newest_remote)
        return max(candidates, default=None)

    @overload
    def restore(
        self,
        step: int | None = None,
        *,
        world_size: int | None = None,
        reshard: bool = False,
        verify: Verify | None = None,
        into: Sequence[State] | State | None = None,
        missing_ok: Literal[False] = False,
    ) -> RestoreResult: ...

    @overload
    def restore(
        self,
        step: int | None = None,
        *,
        world_size: int | None = None,
        reshard: bool = False,
        verify: Verify | None = None,
        into: Sequence[State] | State | None = None,
        missing_ok: bool,
    ) -> RestoreResult | None: ...

    def restore(
        self,
        step: int | None = None,
        *,
        world_size: int | None = None,
        reshard: bool = False,
        verify: Verify | None = None,
        into: Sequence[State] | State | None = None,
        missing_ok: bool = False,
    ) -> RestoreResult | None:
        """Load a committed step (default: the newest) with every shard verified.

        ``world_size`` (default: the manager's) must match the checkpoint's, else
        :class:`WorldSizeMismatchError`, unless ``reshard=True`` asks for the flat
        shards to be re-cut for it. ``verify="fast"`` checks xxh3-64 instead of sha256
        (default: the manager's ``verify``).
        ``into`` fills the caller's arrays in place (not with resharding). A damaged
        step fails loudly with the step, rank and file named; it never falls back to
        an older step by itself. ``missing_ok=True`` returns None instead of raising
        when no tier (of no rank) holds any committed step: a fresh start.

        With one process per rank every rank calls it and gets its own rank's state
        (:attr:`RestoreResult.state`); the step is the newest that every rank holds
        locally or the bucket holds, and a failure on any rank raises on every rank.
        """
        self._check_open()
        self._wait_for_last_save()
        verify = self.verify if verify is None else verify
        target = self.world_size if world_size is None else world_size
        reports = self._agree(lambda: self._report_steps(step, target, reshard))
        _check_same_call(reports, "restore")
        remote_steps: list[int] = reports[0]["remote"]
        committed = [{int(key) for key in report["local"]} for report in reports]  # per process
        complete = sorted(set(remote_steps).union(committed[0].intersection(*committed[1:])))
        chosen: int | None = leader_decides(
            self._coordinator, lambda: self._choose_step(step, complete, committed, missing_ok)
        )
        if chosen is None:
            return None
        loaded: list[RestoreResult] = []
        agree(
            self._coordinator,
            lambda: loaded.append(self._load_step(chosen, chosen in remote_steps, target, reshard, verify, into)),
        )
        self._drop_unfinished_commits(chosen, complete, reports)
        return loaded[0]

    def _report_steps(self, asked: int | None, target: int, reshard: bool) -> dict[str, Any]:
        """This process's restore arguments, committed steps (with the world size each was saved
        with) and, on the leader, the bucket's; a background error not yet raised is raised instead."""
        self._raise_background_error()
        if not self._one_process and target != self.world_size:
            raise InvalidStateError(f"with one process per rank the world size is the coordinator's, {self.world_size}")
        local: dict[str, int | None] = {}
        for step in committed_steps(self.root):
            try:
                local[str(step)] = read_manifest(self.root / step_dir_name(step)).world_size
            except ManifestError:
                local[str(step)] = None  # damaged: the restore falls back to the remote manifest or fails
        remote = self.remote_steps() if self._coordinator.is_leader else None
        arguments = {"step": asked, "world_size": target, "reshard": reshard}
        return {"arguments": arguments, "local": local, "remote": remote}

    def _choose_step(
        self, step: int | None, complete: list[int], committed: list[set[int]], missing_ok: bool
    ) -> int | None:
        """Leader: the step every rank restores (None: nothing anywhere, and ``missing_ok``)."""
        if missing_ok and step is None and not complete and not set().union(*committed):
            return None
        for partial in sorted(set().union(*committed) - set(complete)):
            holders = [rank for rank, steps in enumerate(committed) if partial in steps]
            logger.warning(
                "step %d is committed on ranks %s only and not in the bucket (a save cut short between "
                "ranks' commits, or a node's disk replaced): it cannot be restored",
                partial,
                holders,
            )
        if step is None:
            if not complete:
                raise IncompleteCheckpointError(f"{self._where()}: no committed checkpoint to restore")
            return complete[-1]
        if step not in complete:
            raise IncompleteCheckpointError(
                f"{self._where()}: step {step} is not committed; committed steps: {complete}"
            )
        return step

    def _load_step(
        self,
        step: int,
        in_remote: bool,
        target: int,
        reshard: bool,
        verify: Verify,
        into: Sequence[State] | State | None,
    ) -> RestoreResult:
        """This process's part of a restore: its ranks' verified states (resharded when asked)."""
        directory = self.root / step_dir_name(step)
        in_local = is_committed(directory)
        into_list = [into] if isinstance(into, Mapping) else into
        try:
            manifest, remote = self._restore_manifests(step, in_local, in_remote)
            if not reshard:
                check_world_size(manifest, target, str(directory))
            elif into_list is not None:
                raise InvalidStateError("into cannot be combined with reshard=True")
            if self._one_process:
                check_into(into_list, manifest)
            elif into_list is not None and len(into_list) != len(self._ranks):
                raise InvalidStateError(f"into holds {len(into_list)} rank states, this process restores one")
            if manifest.world_size == target:
                wanted = list(self._ranks)
            else:
                new_ranks = range(target) if self._one_process else self._ranks
                wanted = sorted({old for rank in new_ranks for old in source_ranks(manifest, target, rank)})
            directory.mkdir(exist_ok=True)
            fallback = self._remote if remote is not None else None
            if fallback is None and not self._one_process:
                _check_on_this_node(directory, manifest, wanted)
            fetched = run_parallel(
                lambda index: _fetch_shard(
                    directory,
                    step,
                    manifest.shard(wanted[index]),
                    fallback,
                    verify,
                    into_list[index] if into_list is not None else None,
                ),
                range(len(wanted)),
                self._max_workers,
            )
            self._record_fetched(directory, manifest, wanted, in_local)
            if not in_local:  # the local tier is refilled from the bucket
                fsync_directory(directory)
                commit_manifest(directory, manifest)
                if remote is not None and self._remote is not None:
                    write_receipt(directory, self._remote.url, remote)
        except CheckpointError as exc:
            raise restated(exc, f"restore of step {step}: {exc}") from exc
        arrays = {rank: state for rank, (state, _source) in zip(wanted, fetched, strict=True)}
        sources = {rank: source for rank, (_state, source) in zip(wanted, fetched, strict=True)}
        if manifest.world_size == target:
            return RestoreResult(step, [arrays[rank] for rank in self._ranks], sources, self._ranks, manifest)
        if self._one_process:
            states = reshard_states([arrays[rank] for rank in range(manifest.world_size)], manifest, target)
            return RestoreResult(step, states, sources, tuple(range(target)), manifest)
        states = [reshard_rank(arrays, manifest, target, rank) for rank in self._ranks]
        return RestoreResult(step, states, sources, self._ranks, manifest)

    def _record_fetched(self, directory: Path, manifest: ShardManifest, fetched: list[int], in_local: bool) -> None:
        """Record the shards ``directory`` now holds: those it held and those just fetched into it."""
        held: set[int] = set()
        if in_local:
            try:
                held = set(held_ranks(directory, manifest))
            except ManifestError:
                logger.warning("%s: the record of held shards is damaged; rewriting it", directory, exc_info=True)
            else:
                if held >= set(fetched):
                    return  # the record is already right: no durable rewrite on every restore
        record_held_ranks(directory, manifest, held | set(fetched))

    def _drop_unfinished_commits(self, restored: int, complete: list[int], reports: list[dict[str, Any]]) -> None:
        """Delete local steps newer than ``restored`` whose commit did not reach every rank.

        Such a step can never be restored (a rank lacks it and so does the bucket), and
        it would refuse the save of its step number again. Steps of another world size
        are kept: the ranks that would complete them are not in this job.
        """
        for step in committed_steps(self.root):
            sizes = {report["local"].get(str(step), self.world_size) for report in reports}
            if step > restored and step not in complete and sizes == {self.world_size}:
                logger.warning("deleting step %d from %s: its commit did not reach every rank", step, self.root)
                delete_checkpoint(self.root / step_dir_name(step))

    def pull(self, step: int | None = None) -> dict[int, str]:
        """Fill the local tier with a remote step (default: the newest) without loading it.

        Local shards that verify are kept; the others are streamed from the bucket and
        verified. Returns, per rank, the tier each shard now on disk came from.
        """
        self._check_single_process("pull")
        if self._remote is None:
            raise InvalidStateError("pull needs a remote tier (remote_url)")
        remote_steps = self.remote_steps()
        step = remote_steps[-1] if step is None and remote_steps else step
        if step is None or step not in remote_steps:
            raise IncompleteCheckpointError(f"{self._remote.url}: step {step} is not committed remotely")
        remote = self._remote.read_manifest(step)
        directory = self.root / step_dir_name(step)
        directory.mkdir(exist_ok=True)

        def fetch(record: ShardRecord) -> str:
            if check_shard_file(directory, record) is None:
                return "local"
            assert self._remote is not None
            self._remote.download_shard(step, record, directory / record.path)
            return "remote"

        sources = run_parallel(fetch, remote.manifest.shards, self._max_workers)
        record_held_ranks(directory, remote.manifest, range(remote.manifest.world_size))
        if step not in self.steps():
            fsync_directory(directory)
            commit_manifest(directory, remote.manifest)
        write_receipt(directory, self._remote.url, remote)
        return dict(enumerate(sources))

    def push(self, step: int | None = None) -> list[int]:
        """Upload ``step`` (default: every local step not yet committed remotely) and wait for it.

        Returns the steps uploaded; raises :class:`UploadError` if one fails.
        """
        self._check_single_process("push")
        if self._remote is None or self._uploader is None:
            raise InvalidStateError("push needs a remote tier (remote_url)")
        local = self.steps()
        if step is not None and step not in local:
            raise IncompleteCheckpointError(f"{self.root}: step {step} is not committed locally")
        pending = [s for s in local if not read_receipt(self.root / step_dir_name(s), self._remote.url)]
        chosen = [step] if step is not None else pending
        for each in chosen:
            if each not in self._uploader.pending() and each in pending:
                self._uploader.submit(each, bounded=False)
        self.wait(uploaded=True)
        return [each for each in chosen if each in pending]

    def prune(self, *, dry_run: bool = False) -> dict[str, list[int]]:
        """Apply retention to both tiers now; return the steps deleted (or, with ``dry_run``, to delete)."""
        self._check_single_process("prune")
        self.wait(uploaded=True)
        local = committed_steps(self.root)
        plan = {"local": _to_delete(local, self.keep_last, self.keep_every, self._awaiting_upload(local))}
        remote_steps = self.remote_steps()
        plan["remote"] = _to_delete(remote_steps, self.keep_last_remote, self.keep_every_remote) if self._remote else []
        if not dry_run:
            for step in plan["local"]:
                delete_checkpoint(self.root / step_dir_name(step))
            for step in plan["remote"]:
                assert self._remote is not None
                self._remote.delete_step(step)
        return plan

    def _where(self) -> str:
        return str(self.root) + (f" and {self._remote.url}" if self._remote is not None else "")

    def _restore_manifests(
        self, step: int, in_local: bool, in_remote: bool
    ) -> tuple[ShardManifest, RemoteManifest | None]:
        """The step's manifest (local if it validates, else remote) and its remote manifest if any."""
        remote = self._remote.read_manifest(step) if in_remote and self._remote is not None else None
        if not in_local:
            assert remote is not None
            return remote.manifest, remote
        try:
            local = read_manifest(self.root / step_dir_name(step))
        except ManifestError:
            if remote is None:
                raise
            logger.warning("the local manifest of step %d is damaged; using the remote one", step)
            return remote.manifest, remote
        if remote is not None and remote.manifest.shards != local.shards:
            raise ManifestError(f"the local and remote manifests of step {step} describe different checkpoints")
        return local, remote


def _check_on_this_node(directory: Path, manifest: ShardManifest, ranks: list[int]) -> None:
    """Without a bucket, a rank can read only the shards on its own disk: say so if some are not."""
    absent = [rank for rank in ranks if not (directory / manifest.shard(rank).path).is_file()]
    if absent:
        raise IncompleteCheckpointError(
            f"{directory}: the shards of ranks {absent} are not on this node's disk and no remote tier holds "
            f"step {manifest.step}; reading another node's shards (to reshard, or after ranks moved between "
            "nodes) needs a bucket (remote_url)"
        )


def _check_same_call(reports: list[dict[str, Any]], call: str) -> None:
    """Raise :class:`InvalidStateError` on every rank if the ranks made ``call`` with different arguments."""
    arguments = {rank: report["arguments"] for rank, report in enumerate(reports)}
    if len({json.dumps(value, sort_keys=True) for value in arguments.values()}) > 1:
        raise InvalidStateError(f"the ranks called {call} with different arguments: {arguments}")


_LOCAL_FAILURES = (IncompleteCheckpointError, ChecksumMismatchError, ShardFormatError)


def _fetch_shard(
    directory: Path,
    step: int,
    record: ShardRecord,
    remote: RemoteTier | None,
    verify: Verify,
    into: State | None,
) -> tuple[dict[str, np.ndarray], str]:
    """One shard's verified arrays and the tier they came from: local if intact, else the bucket.

    The remote copy is downloaded into the local step (refilling it), verified while it
    streams and again as it is read; a failed download is tried once more. If no copy
    verifies, the error names every copy tried.
    """
    try:
        return read_shard_file(directory, record, verify, into), "local"
    except _LOCAL_FAILURES as local_error:
        if remote is None:
            raise
        tried: list[tuple[str, CheckpointError]] = [(f"local {directory / record.path}", local_error)]
        for _attempt in range(2):
            try:
                remote.download_shard(step, record, directory / record.path)
                return read_shard_file(directory, record, verify, into), "remote"
            except (*_LOCAL_FAILURES, RemoteError) as remote_error:
                tried.append((f"remote {remote.location(step, record.path)}", remote_error))
        mismatch = any(isinstance(error, ChecksumMismatchError) for _copy, error in tried)
        error_type = ChecksumMismatchError if mismatch else IncompleteCheckpointError
        listing = "; ".join(f"{copy}: {error}" for copy, error in tried)
        raise error_type(f"rank {record.rank}: no copy verifies; tried {listing}") from tried[-1][1]


def _to_delete(
    steps: list[int], keep_last: int | None, keep_every: int | None, protected: Iterable[int] = ()
) -> list[int]:
    """Steps retention deletes: all but the newest ``keep_last``, the multiples of
    ``keep_every``, the newest step and ``protected``."""
    keep = set(steps[-keep_last:]) if keep_last is not None else set(steps)
    if keep_every is not None:
        keep |= {step for step in steps if step % keep_every == 0}
    keep |= set(steps[-1:]) | set(protected)
    return [step for step in steps if step not in keep]
