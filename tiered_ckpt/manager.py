"""``CheckpointManager``: the object a training job holds for the whole run.

It is composed of the parts below it and owns only the order of a save:

1. raise any background error not yet raised; wait for the previous save's write;
2. check the call on every rank (one collective), then stage: copy every array into
   host buffers reused from save to save (the only time the training loop is blocked);
3. on the writer thread: write this process's shards (temp file, hashed as it streams,
   fsync, rename), exchange the shard records, commit the manifest in the local tier
   once every rank's shard is durable, and hand the step to the uploader;
4. after the save's handle has resolved, on a thread of its own: local retention.

Restores are :class:`~tiered_ckpt.restore.Restorer`'s, uploads and everything after them
the :class:`~tiered_ckpt.uploader.Uploader`'s, and both tiers are reached only through
the :class:`~tiered_ckpt.store.TieredStore`. Background threads leave their failures in
one :class:`~tiered_ckpt.errors.ErrorBox`; they never call back into the manager.

With one process per rank (a :class:`~tiered_ckpt.TorchDistributedCoordinator`), each
process saves and restores its own rank into a local directory of its own; collectives
run on the caller's thread (the checks), the writer's and the uploader's, each on a
process group of its own, so they never meet the training loop's collectives. Every
rank must make the same calls in the same order, as with any collective.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import signal
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, closing, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar, Unpack, overload

from tiered_ckpt.config import Config, load_config
from tiered_ckpt.dist.coordination import Attempt, Coordinator, Done, gather, resolve_coordinator
from tiered_ckpt.dist.sharding import resolve_sharded_keys, sharding_summary
from tiered_ckpt.engine.preemption import PreemptionNotice, PreemptionWatch
from tiered_ckpt.engine.restore import Restorer, check_restore_arguments
from tiered_ckpt.engine.restore_result import RestoreResult
from tiered_ckpt.engine.staging import StagingBuffers
from tiered_ckpt.engine.step_choice import same_call
from tiered_ckpt.engine.uploader import Uploader
from tiered_ckpt.engine.writer import SaveHandle, Writer, check_cpus
from tiered_ckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
    ConfigError,
    DirectoryInUseError,
    ErrorBox,
    SaveError,
    UploadError,
    UsageError,
    restated,
)
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.format.state import FlatState, State, flatten
from tiered_ckpt.format.validate import check_manifest_fits, validate_states, validate_step
from tiered_ckpt.io.hashing import Verify
from tiered_ckpt.options import LocalOptions, ManagerKeywords, Options, RemoteOptions, UploadOptions, resolve_options
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.store import Lag, TieredStore

__all__ = ["CheckpointManager", "SaveHandle", "RestoreResult", "StagingBuffers"]

logger = logging.getLogger("tiered_ckpt")
T = TypeVar("T")


@contextmanager
def _not_saved(step: int) -> Iterator[None]:
    """Around a save's check: a background error it raises says that this save's step was not saved."""
    try:
        yield
    except (SaveError, UploadError) as exc:
        raise restated(exc, f"{exc} (so step {step} was not saved: nothing of it was written)") from exc.__cause__


@dataclass(frozen=True)
class _SaveReport:
    """One process's check of a save call: its arguments, its newest step, its arrays' shapes per
    rank, whether each of its ranks' states is a flat dict of arrays, and the most bytes each of
    its ranks' records may add to the manifest."""

    arguments: str
    newest: int | None
    shapes: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]
    flat: bool
    record_bytes: tuple[int, ...]


class CheckpointManager:
    """Saves, retains and restores the checkpoints of one training job in ``local_dir``.

    ``world_size`` ranks are saved per step, each into its own shard. By default one
    process holds them all; with ``coordinator=TorchDistributedCoordinator()`` each
    process holds its own rank (``world_size`` then defaults to the coordinator's), and
    ``local_dir`` must be this process's own directory (one per rank, e.g. on the node's
    local disk; two processes cannot share one). ``sharded_keys`` names the
    flat-parameter slices (default: the arrays 1-D on every rank, see
    :func:`~tiered_ckpt.save_sharded`). Starting a manager removes what crashed saves
    left in ``local_dir``; two managers cannot hold one directory at once
    (:class:`DirectoryInUseError`).

    The options: ``local_dir`` may be a :class:`~tiered_ckpt.options.LocalOptions`,
    ``remote`` a :class:`~tiered_ckpt.options.RemoteOptions` and ``upload`` an
    :class:`~tiered_ckpt.options.UploadOptions` (what :func:`~tiered_ckpt.load_config`
    returns); the keyword arguments (``keep_last=3``, ``keep_every``, ``verify="full"``,
    ``remote_url``, ``storage_options``, ``keep_last_remote``, ``keep_every_remote``,
    ``upload_concurrency``, ``upload_max_tries``, ``upload_backoff_seconds``,
    ``max_pending_uploads``, ``when_uploads_behind``) each set one field of them. ``keep_last``
    keeps the newest steps (None keeps all), ``keep_every`` also keeps every step
    divisible by it; the newest committed step is never deleted.

    ``writer_cpus`` (e.g. ``{3}``; Linux) keeps the background writer and retention threads,
    and the threads they start, on those CPUs (say, cores the training loop leaves free);
    they always run at a lower priority than the training loop.

    ``preemption_signals`` (e.g. ``(signal.SIGTERM,)``; default none) installs handlers
    that note a preemption notice for :meth:`reached_preemption`, only from the main
    thread: one per signal for the process, shared by every manager, chained to a Python
    handler it replaced but never to the default action (``SIG_DFL``, SIGINT's
    ``KeyboardInterrupt``), which the notice replaces; the last manager to close puts the
    old handler back, whatever order managers close in.

    Use it as a context manager, or call :meth:`close` at the end of the run.
    """

    def __init__(
        self,
        local_dir: str | os.PathLike[str] | LocalOptions,
        *,
        world_size: int | None = None,
        coordinator: Coordinator | None = None,
        remote: RemoteOptions | None = None,
        upload: UploadOptions | None = None,
        sharded_keys: Iterable[str | Sequence[str | int]] | None = None,
        max_workers: int | None = None,
        writer_cpus: Iterable[int] | None = None,
        preemption_signals: Iterable[int | signal.Signals] = (),
        **keywords: Unpack[ManagerKeywords],
    ) -> None:
        options = resolve_options(local_dir, remote, upload, keywords, _PARAMETERS)
        cpus = check_cpus(writer_cpus)
        coordinator = resolve_coordinator(coordinator, world_size)
        world_size = coordinator.world_size
        self._ranks = tuple(coordinator.local_ranks)
        if len(self._ranks) != world_size and options.upload.when_behind == "skip":
            # from_config names the file or variable of a value that came from a config (field "upload.when_behind")
            given = "when_uploads_behind" in keywords
            problem = (
                "is 'skip', which needs one process holding every rank "
                "(with one process per rank, ranks could skip different steps); use 'wait'"
            )
            key = "when_uploads_behind" if given else "upload.when_behind"
            error = ConfigError(f"{'keyword argument ' if given else ''}{key} {problem}")
            error.field, error.problem = key, problem
            raise error
        self.options = options
        self.world_size = world_size
        self._coordinator = coordinator
        self._sharded_keys = tuple(sharded_keys) if sharded_keys is not None else None
        self._max_workers = max_workers
        self._errors = ErrorBox()
        self._closed = False
        remote_tier = (
            options.remote.open_tier(options.upload, check_bucket=False) if options.remote is not None else None
        )
        self._store = TieredStore(LocalTier(options.local.dir), remote_tier)
        self._restorer = Restorer(self._store, coordinator, world_size, max_workers)
        self._uploader: Uploader | None = None
        self._exit_stack = ExitStack()
        try:
            gather(coordinator, "open", Done, Attempt.run(self._open_local_dir).done)
            if remote_tier is not None:
                self._uploader = self._exit_stack.enter_context(closing(self._start_uploader(options)))
                self._uploader.resume()
            notice = self._exit_stack.enter_context(closing(PreemptionNotice(preemption_signals)))
            channel = coordinator if self._one_process else coordinator.new_channel()
            self._preemption = PreemptionWatch(notice, channel)
        except BaseException:
            self._exit_stack.close()  # release the directory and stop the uploader: nothing is half-open
            raise
        self._writer = Writer(
            self._store,
            coordinator,
            world_size=world_size,
            errors=self._errors,
            retention=options.local.retention,
            uploader=self._uploader,
            max_workers=max_workers,
            cpus=cpus,
        )

    def _start_uploader(self, options: Options) -> Uploader:
        assert options.remote is not None
        return Uploader(
            self._store,
            options=options.upload,
            errors=self._errors,
            coordinator=self._coordinator.new_channel(),
            ranks=self._ranks,
            local_retention=options.local.retention,
            remote_retention=options.remote.retention,
            ownership=options.remote.ownership,
        )

    def _open_local_dir(self) -> None:
        """Lock the local directory, remove what crashed saves left in it, and check the bucket."""
        try:
            self._exit_stack.enter_context(self._store.local.lock())
        except DirectoryInUseError as exc:
            if self._one_process:
                raise
            raise DirectoryInUseError(
                f"{exc}; with one process per rank, give each rank a local_dir of its own"
            ) from exc
        removed = self._store.local.remove_uncommitted()
        if removed:
            logger.warning("removed what crashed saves left in %s: %s", self.root, ", ".join(removed))
        if self._store.remote is not None:  # on every rank, in this collective: one rank's failure fails all
            self._store.remote.check_bucket()

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
        local = config.local if local_dir is None else replace(config.local, dir=Path(local_dir))
        arguments = {"remote": config.remote, "upload": config.upload, "verify": config.verify.mode, **kwargs}
        try:
            return cls(local, world_size=world_size, **arguments)
        except ConfigError as exc:  # a config value refused here (not by its own check) names its file or variable
            if exc.field is None or exc.field not in config.origins:
                raise
            raise ConfigError(f"{config.origins[exc.field]}: key '{exc.field}' {exc.problem}") from None

    # -- what the manager is ------------------------------------------------------------

    @property
    def root(self) -> Path:
        """The local directory."""
        return self.options.local.dir

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks this process saves and restores (one, with one process per rank)."""
        return self._ranks

    @property
    def keep_last(self) -> int | None:
        return self.options.local.keep_last

    @property
    def keep_every(self) -> int | None:
        return self.options.local.keep_every

    @property
    def verify(self) -> Verify:
        """How :meth:`restore` verifies shards unless told otherwise."""
        return self.options.verify.mode

    @property
    def store(self) -> TieredStore:
        """Both tiers, for reading (steps, manifests, verification); the manager does the writing."""
        return self._store

    def __repr__(self) -> str:
        remote = f", remote_url={self.options.remote.url!r}" if self.options.remote is not None else ""
        return (
            f"CheckpointManager({str(self.root)!r}, world_size={self.world_size}, "
            f"keep_last={self.keep_last}, keep_every={self.keep_every}{remote})"
        )

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        if self._uploader is not None:  # leaving on an error: a failing bucket is not waited for
            self._uploader.give_up_retries()
        try:
            self.close()
        except CheckpointError:
            # The exception already propagating is the one the caller needs to see.
            logger.exception("error while closing %r during another exception", self)

    # -- saving -------------------------------------------------------------------------

    def save(self, step: int, states: Sequence[State] | State, *, blocking: bool = False) -> SaveHandle:
        """Checkpoint ``states`` (one state per rank) as ``step``.

        A state is a dict nesting dicts, lists and tuples of numpy arrays, torch tensors
        and scalars (see :mod:`tiered_ckpt.state`); ``restore`` gives it back with its
        types. With one process per rank, ``states`` is this rank's state (every rank
        calls ``save`` with the same step). Returns once the arrays are copied to staging
        buffers: the caller may then overwrite its arrays. The write runs in the
        background; ``blocking=True`` waits for the commit. Raises first any background
        error not yet raised (:class:`SaveError`, or a permanent :class:`UploadError`: no
        such bucket, access denied), saying that ``step`` was not saved, then
        :class:`InvalidStateError` for bad input and :class:`CheckpointExistsError` if
        ``step`` is not newer than every committed step (on every rank, whichever rank's
        input or directory is at fault). A bucket that is unreachable or failing never
        makes it raise: the upload is retried until its deadline, and a step that misses it
        stays local-only (see :meth:`wait` and :meth:`status`).
        """
        self._check_open()
        self._writer.settle(retention=False)
        with self._raised_on_every_rank(), _not_saved(step):
            checked = Attempt.run(lambda: self._check_save(step, states))
            parsed = gather(self._coordinator, "save", _SaveReport, lambda: checked.value[1])
        flattened = checked.value[0]
        same_call([report.arguments for report in parsed], "save")
        newest = max((report.newest for report in parsed if report.newest is not None), default=None)
        if newest is not None and step <= newest:
            hint = (
                "; ask reached_preemption(step) before the step's regular save, so that the stop step is a new one"
                if self._preemption.step == step == newest
                else ""
            )
            raise CheckpointExistsError(
                f"{self.root}: step {step} is not newer than the newest checkpoint, step {newest}{hint}"
            )
        shapes = [dict(rank_shapes) for report in parsed for rank_shapes in report.shapes]
        flat = all(report.flat for report in parsed)
        keys, numels = resolve_sharded_keys(shapes, self._sharded_keys, flat=flat)
        check_manifest_fits([size for report in parsed for size in report.record_bytes], keys, step)
        handle = self._writer.submit(step, flattened, keys, numels)
        if blocking:
            handle.wait()
        return handle

    def _check_save(self, step: int, states: Sequence[State] | State) -> tuple[list[FlatState], _SaveReport]:
        """This process's part of a save's check: its flattened states (checked) and its report to the others."""
        self._before_collective()
        validate_step(step)
        given = [states] if isinstance(states, Mapping) else states
        validate_states(given, len(self._ranks))
        # torch tensors become numpy views; every value is checked here, inside the
        # collective, so bad input raises on every rank rather than stranding the others
        local = [flatten(state, f"rank {r}") for r, state in zip(self._ranks, given, strict=True)]
        shapes = tuple(tuple((key, tuple(shape)) for key, shape in sharding_summary(s.arrays).items()) for s in local)
        flat = all(s.structure.flat for s in local)
        records = tuple(s.record_bytes() for s in local)
        report = _SaveReport(json.dumps({"step": step}), self.latest_step(), shapes, flat, records)
        return local, report

    def _before_collective(self) -> None:
        """What every save and restore checks first, on every rank: a background error not yet
        raised (not a step that only missed its upload deadline), and that the directory is
        still the one this manager locked."""
        self._errors.raise_first(transient=False)
        self._store.local.check_locked()

    @contextmanager
    def _raised_on_every_rank(self) -> Iterator[None]:
        """Around the collectives of save and restore, where background errors are raised by every rank.

        A rank's uploader may record a failed upload (agreed by every rank's uploader)
        a moment before or after another's: the rank that has it raises it inside the
        collective, so every rank raises it at the same call, and the others' copies,
        when they arrive, are not raised again.
        """
        try:
            yield
        except UploadError as error:
            self._errors.mark_raised(error)
            raise

    def reached_preemption(self, step: int) -> bool:
        """True once a ``preemption_signals`` signal has arrived: save ``step`` now and wait for its upload.

        Cheap enough to call at every step. With one process per rank it is a collective
        (every rank calls it at the same step) that returns True on every rank at the same
        step if any rank was signalled. From then on, uploads put the newest step first.
        Ask it after the step's training and before the step's regular save, so that the
        stop step is never one saved already (a signal that arrives during or after the
        regular save is answered at the next step)::

            train_one_step()
            if manager.reached_preemption(step):
                manager.save(step, state, blocking=True)
                manager.wait(uploaded=True)
                sys.exit(0)
            if step % 200 == 0:
                manager.save(step, state)
        """
        self._check_open()
        preemption = self._preemption.reached(step)
        if preemption.new and self._uploader is not None:
            self._uploader.preempt()
        return preemption.stop

    def wait(self, *, uploaded: bool = False) -> None:
        """Block until every save so far is committed locally (and, with ``uploaded=True``,
        committed remotely or past its upload deadline).

        Raises a background error not yet raised: :class:`SaveError` or a permanent
        :class:`UploadError`; with ``uploaded=True`` also the :class:`UploadError` (``transient``
        True) of the steps that missed their deadline while the bucket was unreachable (one
        error naming them all; ``step`` is the newest), since the caller asked for the
        bucket's copy (e.g. before exiting on a preemption notice) and does not have it. Each
        such step is reported once; its local copy is kept.
        """
        self._writer.settle()
        if uploaded and self._uploader is not None:
            self._uploader.wait()
        self._errors.raise_first(transient=False)
        missed = self._errors.take_transient() if uploaded else []
        if len(missed) == 1:
            raise missed[0]
        if missed:
            steps = ", ".join(str(error.step) for error in missed)
            last = missed[-1]
            raise restated(
                last, f"steps {steps} missed their upload deadline and stay local-only; the last: {last}"
            ) from last.__cause__

    def close(self) -> None:
        """Finish pending saves and uploads, release the directory, and raise a background error not yet raised.

        Uploads are waited for until each is committed or past its deadline. A step that
        missed its deadline while the bucket was unreachable is logged (WARNING), not raised:
        it is safe on local disk, a manager started on this directory uploads it again, and
        a job ending while its bucket is down should not fail for it. A permanent failure
        (no such bucket, access denied, a failed save) is raised. Leaving a ``with`` block on an
        exception does not wait for a failing bucket: each upload still queued gets one try.
        Calling it again does nothing.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._writer.close()
        finally:
            self._exit_stack.close()  # finishes the uploads (LIFO), then releases the directory
        for missed in self._errors.take_transient():
            logger.warning("closing %r: step %d is on local disk only: %s", self, missed.step, missed)
        self._errors.raise_first()

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError(f"{self!r} is closed")

    # -- listing and restoring -------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps in the local directory, oldest first."""
        return self._store.local.steps()

    def remote_steps(self) -> list[int]:
        """Steps committed in the remote tier, oldest first (empty without a remote tier)."""
        return self._store.remote_steps()

    def latest_step(self) -> int | None:
        """The newest step committed in either tier, or None if there is none.

        With one process per rank this is this rank's view (its own directory and the
        bucket as of its last upload); :meth:`restore` is what makes the ranks agree.
        """
        steps = self.steps()
        remote = self._uploader.newest_committed if self._uploader is not None else None
        return max([*steps[-1:], *([remote] if remote is not None else [])], default=None)

    def status(self) -> Lag:
        """How far the bucket is behind this process's disk: the newest step of each tier, the
        steps waiting for upload with their bytes and how long the oldest has waited, the rate
        of the last remote commits, and the last upload failure with its time (see
        :class:`~tiered_ckpt.store.Lag`). Cheap enough to call every step: it reads local
        manifests and lists nothing remote."""
        uploader = self._uploader
        if uploader is None:
            return self._store.lag()
        lag = self._store.lag(uploader.pending(), uploader.newest_committed)
        failed = uploader.last_error
        retrying = uploader.retrying()
        return dataclasses.replace(
            lag,
            upload_bytes_per_second=uploader.upload_rate(),
            last_error=failed[1] if failed else None,
            last_error_at=failed[0] if failed else None,
            retrying_step=retrying[0] if retrying else None,
            retry_tries=retrying[1] if retrying else 0,
        )

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
        (default: the manager's ``verify``). ``into`` (a state of the same nesting) fills
        the caller's arrays and CPU tensors in place; with resharding only a state of
        DTensors, whose chunks are then filled from the saved chunks that overlap them,
        each read in part and verified by its own sha256. A damaged step fails loudly
        with the step, rank and file named; it never falls back to an older step by
        itself. ``missing_ok=True``
        returns None instead of raising when no tier (of no rank) holds any committed
        step: a fresh start.

        With one process per rank every rank calls it and gets its own rank's state
        (:attr:`RestoreResult.state`); the step is the newest that every rank holds
        locally or the bucket holds, and a failure on any rank raises on every rank.
        """
        self._check_open()
        self._writer.settle()
        verify = self.verify if verify is None else verify
        target = self.world_size if world_size is None else world_size
        check_restore_arguments(step, target, verify, into)
        with self._raised_on_every_rank():
            return self._restorer.restore(
                step,
                world_size=target,
                reshard=reshard,
                verify=verify,
                into=into,
                missing_ok=missing_ok,
                checked=Attempt.run(self._before_collective),
            )

    def locate(self, step: int | None = None) -> ShardManifest:
        """The manifest of ``step`` (default: the newest step every rank can restore), agreed by
        every rank (a collective with one process per rank). For readers of their own, such as
        :class:`tiered_ckpt.torch.TieredReader`; :meth:`restore` does this itself."""
        self._check_open()
        self._writer.settle()
        with self._raised_on_every_rank():
            return self._restorer.locate(step, checked=Attempt.run(self._before_collective))

    # -- moving whole steps (one process holding every rank, as the CLI runs it) ---------------

    def _single_process_store(self, operation: str) -> TieredStore:
        self._check_open()
        if not self._one_process:
            raise UsageError(
                f"{operation} is a maintenance operation of one process holding every rank (as the CLI runs it); "
                "saves of one process per rank upload and prune by themselves"
            )
        self.wait()
        return self._store

    def pull(self, step: int | None = None) -> dict[int, str]:
        """Fill the local tier with a remote step (default: the newest) without loading it.

        Local shards that verify are kept; the others are streamed from the bucket and
        verified. Returns, per rank, the tier each shard now on disk came from.
        """
        return dict(self._single_process_store("pull").pull(step, max_workers=self._max_workers)[1])

    def push(self, step: int | None = None) -> list[int]:
        """Upload ``step`` (default: every local step not yet committed remotely) and wait for it.

        Returns the steps uploaded; raises :class:`UploadError` if one fails.
        """
        self._single_process_store("push")
        if self._uploader is None:
            raise UsageError("push needs a remote tier (remote_url)")
        return self._uploader.push(step)

    def prune(self, *, dry_run: bool = False) -> dict[str, list[int]]:
        """Apply retention to both tiers now; return the steps deleted (or, with ``dry_run``, to delete)."""
        store = self._single_process_store("prune")
        if self._uploader is not None:
            self.wait(uploaded=True)
        remote = self.options.remote.retention if self.options.remote is not None else None
        return store.prune(self.options.local.retention, remote, dry_run=dry_run)


# The named parameters of CheckpointManager, for the close matches of a mistyped keyword.
_PARAMETERS = tuple(inspect.signature(CheckpointManager).parameters)[1:-1]  # not local_dir, not **keywords
