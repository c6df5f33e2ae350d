"""The local tier: checkpoints in step directories on this node's disk.

A checkpoint directory is committed exactly when its ``manifest.json`` exists, and the
manifest is written (atomically, see :mod:`tiered_ckpt.io.durable`) only after every shard
it names is durable under its final name. Deleting one removes the manifest first.

Reads treat what is on disk as untrusted: a shard is opened only if it is a regular
file (never a symlink, a FIFO or a device, which could lead outside the checkpoint or
block forever), its size is checked before it is mapped, and its bytes are hashed
before they are returned. :class:`LocalTier` holds a directory for a running job (its
lock) and, beside the tier protocol (:mod:`tiered_ckpt.tiers.base`), records in each step:
the ranks whose shards it holds, whether the ranks agreed the commit, a later tier's receipt.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import BinaryIO, TypeVar

import numpy as np

from tiered_ckpt.errors import (
    CheckpointError,
    ChecksumMismatchError,
    DirectoryInUseError,
    IncompleteCheckpointError,
    ManifestError,
    UsageError,
)
from tiered_ckpt.format.layout import (
    KEPT_NAME,
    KEPT_PREFIX,
    MANIFEST_NAME,
    is_shard_name,
    parse_step_dir_name,
    step_dir_name,
)
from tiered_ckpt.format.manifest import MAX_MANIFEST_BYTES, ShardManifest, ShardRecord
from tiered_ckpt.format.remote_manifest import RemoteManifest
from tiered_ckpt.format.shardfile import read_shard_file
from tiered_ckpt.format.state import FlatState, own_targets
from tiered_ckpt.io.durable import atomic_write, fsync_directory, write_bytes
from tiered_ckpt.io.files import directory_lock, open_regular, read_small, remove_temp_files
from tiered_ckpt.io.hashing import ShardDigest, Verify, check_verify, copy_and_hash, hash_stream, read_hashing
from tiered_ckpt.tiers import step_records
from tiered_ckpt.tiers.base import Capabilities, Landed, ShardSource

__all__ = ["LocalTier"]

T = TypeVar("T")

logger = logging.getLogger("tiered_ckpt")

# A local commit replaces a manifest already there (an atomic rename): the writer never
# lands a step twice, and a save into a committed one-step directory is refused before it
# writes (save_sharded's CheckpointExistsError), so the tier itself is not create-only.
CAPABILITIES = Capabilities(
    durable=True, shared=False, create_only_commit=False, store_checksums=False, ranged_reads=True, references=True
)


def _copy_file(origin: Path | None, out: BinaryIO) -> ShardDigest:
    """Copy the file at ``origin`` (a :class:`ShardSource` has it if it has no write function) to ``out``."""
    assert origin is not None
    with open(origin, "rb") as copied:
        return copy_and_hash(copied, out)


def _write_manifest(directory: Path, manifest: ShardManifest) -> None:
    """The commit itself: durably write ``manifest`` into ``directory`` (every shard is durable there)."""
    write_bytes(directory / MANIFEST_NAME, manifest.to_json().encode())


def _read_manifest(directory: Path) -> ShardManifest:
    """The strictly validated manifest in ``directory``: :class:`IncompleteCheckpointError` if there
    is none, :class:`ManifestError` if it does not validate (or is not a regular file, or too large)."""
    path = directory / MANIFEST_NAME
    try:
        data = read_small(path, MAX_MANIFEST_BYTES)
    except IncompleteCheckpointError as exc:
        if not os.path.lexists(path):
            raise IncompleteCheckpointError(
                f"{directory}: no {MANIFEST_NAME}, the checkpoint was never committed"
            ) from None
        raise ManifestError(str(exc)) from None
    return ShardManifest.from_json(data, source=str(path))


@contextmanager
def _read_errors(what: str) -> Iterator[None]:
    """Raise an OSError of reading a shard (EIO from a failing disk) as :class:`IncompleteCheckpointError`
    naming ``what``, the OSError chained: the copy cannot be read, and the store then tries the next tier."""
    try:
        yield
    except OSError as exc:
        raise IncompleteCheckpointError(f"{what}: read error: {exc.strerror or exc}") from exc


def _holds_anything(directory: Path) -> bool:
    """True if ``directory`` has an entry (False if it is empty or gone)."""
    try:
        with os.scandir(directory) as entries:
            return next(entries, None) is not None
    except FileNotFoundError:
        return False


def _remove_empty(directories: list[Path]) -> None:
    """Remove ``directories`` (each the parent of the one before) while they are empty."""
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:  # not empty (a step was saved), or already gone: keep it and its parents
            return


class LocalTier:
    """The checkpoints of one job under ``root``, on this node's disk.

    Reading (steps, manifests, shards) needs nothing else; a job that writes first takes
    :meth:`lock`, after which every write checks that ``root`` is still the directory it
    locked (a directory deleted and recreated under a running job belongs to someone else).

    ``single_step=True``: ``root`` is one checkpoint's own directory (the layout of
    :func:`~tiered_ckpt.oneshot.save_sharded`), the step directory of whatever step it holds;
    deleting its step removes the checkpoint's files and leaves the directory and anything
    else in it.
    """

    name = "local"
    capabilities = CAPABILITIES

    def __init__(self, root: str | os.PathLike[str], *, single_step: bool = False) -> None:
        self.root = Path(root)
        self.url = str(self.root)
        self._single = single_step
        self._locked: tuple[int, int] | None = None

    def __repr__(self) -> str:
        return f"LocalTier({str(self.root)!r}{', single_step=True' if self._single else ''})"

    def step_dir(self, step: int) -> Path:
        return self.root if self._single else self.root / step_dir_name(step)

    def kept_dir(self, step: int) -> Path:
        """Where the files of deleted ``step`` that later steps reference are kept (a name no
        release's clean-up of crashed saves touches)."""
        return self.root / f"{KEPT_PREFIX}{step_dir_name(step)}"

    def shard_path(self, step: int, record: ShardRecord) -> Path:
        """``record``'s shard of ``step``: in the step's directory, or, for a deleted step whose
        file later steps reference, in its kept directory (moved there atomically, so that one of
        the two holds it at any time)."""
        path = self.step_dir(step) / record.path
        if not self._single and not os.path.lexists(path):
            kept = self.kept_dir(step) / record.path
            if os.path.lexists(kept):
                return kept
        return path

    def shard_location(self, step: int, record: ShardRecord) -> str:
        return str(self.shard_path(step, record))

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold ``root`` (created if needed) for one writer, in any process; raises
        :class:`DirectoryInUseError` at once if another holder has it.

        Directories it created that are still empty when it lets go are removed again (a
        job that failed before its first save, a restore that found nothing, leaves none).
        """
        with ExitStack() as stack:
            for last_try in (False, True):
                created = [directory for directory in (self.root, *self.root.parents) if not directory.exists()]
                self.root.mkdir(parents=True, exist_ok=True)
                try:
                    identity = stack.enter_context(directory_lock(self.root))
                    break
                except FileNotFoundError as exc:
                    # Another holder letting go removed the directory it had created (empty)
                    # between the mkdir and the lock: make it again, once.
                    if last_try:
                        raise DirectoryInUseError(
                            f"{self.root}: removed twice while this job was taking its lock; is another job "
                            "opening and closing on it?"
                        ) from exc
            self._locked = identity
            try:
                yield
            finally:
                self._locked = None
                _remove_empty(created)

    def check_locked(self) -> None:
        """Raise unless this tier holds the lock on the directory now at ``root``."""
        if self._locked is None:
            raise UsageError(f"{self.root}: writing needs the directory's lock (LocalTier.lock)")
        try:
            now = os.stat(self.root)
        except FileNotFoundError:
            now = None
        if now is None or (now.st_dev, now.st_ino) != self._locked:
            raise DirectoryInUseError(
                f"{self.root}: the directory was removed or replaced since this job locked it; "
                "refusing to write into (or delete from) a directory another job may hold"
            )

    # -- reading ------------------------------------------------------------------------

    def _step_dirs(self) -> Iterator[tuple[int, Path]]:
        """Every step directory under ``root`` (single-step: ``root``, if its manifest says which step)."""
        if self._single:
            if os.path.lexists(self.root / MANIFEST_NAME):  # one that is not a valid manifest raises
                yield self.single_manifest().step, self.root
            return
        if not self.root.is_dir():
            return
        for entry in os.scandir(self.root):
            step = parse_step_dir_name(entry.name)
            if step is not None and entry.is_dir(follow_symlinks=False):
                yield step, Path(entry.path)

    def single_manifest(self) -> ShardManifest:
        """The manifest in a single-step directory, of whichever step it is (raises as :meth:`manifest`)."""
        if not self._single:
            raise UsageError(f"{self}: single_manifest is for a single-step directory")
        return _read_manifest(self.root)

    def is_committed(self, step: int) -> bool:
        """True if ``step``'s directory holds a manifest (its validity is checked by :meth:`manifest`)."""
        return (self.step_dir(step) / MANIFEST_NAME).is_file()

    def list_steps(self, *, once: bool = False) -> tuple[list[int], list[int]]:
        """(committed, uncommitted): step directories with a manifest, and those without that hold
        something (being written, or left by a crash), each oldest first. An empty step directory
        holds nothing of a step and is in neither (``once``: nothing to retry, ignored)."""
        committed, uncommitted = [], []
        for step, directory in self._step_dirs():
            if (directory / MANIFEST_NAME).is_file():
                committed.append(step)
            elif _holds_anything(directory) and not (directory / KEPT_NAME).is_file():
                uncommitted.append(step)
        return sorted(committed), sorted(uncommitted)

    def kept_steps(self) -> list[int]:
        """Deleted steps whose files committed steps reference, oldest first: in their kept
        directories, or still in their step directories (marked, no manifest: a deletion a
        crash cut short)."""
        kept = {
            step
            for step, directory in self._step_dirs()
            if (directory / KEPT_NAME).is_file() and not (directory / MANIFEST_NAME).is_file()
        }
        if not self._single and self.root.is_dir():
            for entry in os.scandir(self.root):
                step = (
                    parse_step_dir_name(entry.name[len(KEPT_PREFIX) :]) if entry.name.startswith(KEPT_PREFIX) else None
                )
                if step is not None and entry.is_dir(follow_symlinks=False):
                    kept.add(step)
        return sorted(kept)

    def kept_bytes(self, step: int) -> int:
        """The bytes of the shard files kept of deleted ``step`` (see :meth:`kept_steps`)."""
        total = 0
        for directory in (self.kept_dir(step), self.step_dir(step)):
            if directory.is_dir() and not (directory / MANIFEST_NAME).is_file():
                total += sum(entry.stat().st_size for entry in os.scandir(directory) if is_shard_name(entry.name))
        return total

    def referenced_files(self, *, skip: int | None = None) -> dict[int, set[str]] | None:
        """By step, the shard files the committed steps (but ``skip``) reference in earlier steps'
        directories; None if a committed manifest cannot be read (its references are unknown:
        nothing referenced may then be deleted)."""
        referenced: dict[int, set[str]] = {}
        for step in self.steps():
            if step == skip:
                continue
            try:
                manifest = self.manifest(step)
            except CheckpointError as exc:
                logger.warning("%s: files earlier steps hold are kept: step %d's manifest: %s", self.root, step, exc)
                return None
            for record in manifest.shards:
                for ref in record.references:
                    referenced.setdefault(ref.step, set()).add(ref.file.path)
        return referenced

    def steps(self) -> list[int]:
        return self.list_steps()[0]

    def uncommitted_steps(self) -> list[int]:
        return self.list_steps()[1]

    def manifest(self, step: int) -> ShardManifest:
        """The validated manifest of committed ``step``; one that names another step is refused.

        Raises :class:`IncompleteCheckpointError` if there is none (never committed) and
        :class:`ManifestError` if it does not validate. Reads only what the file holds, and
        nothing of a file over the manifest size limit.
        """
        manifest = _read_manifest(self.step_dir(step))
        if manifest.step != step:
            raise ManifestError(
                f"{self.step_dir(step) / MANIFEST_NAME}: field 'step' is {manifest.step}, the directory is step {step}"
            )
        return manifest

    @contextmanager
    def _open_recorded(self, step: int, record: ShardRecord) -> Iterator[tuple[BinaryIO, str]]:
        """Open ``record``'s shard, a regular file of the recorded size; yields it and its description
        for errors. Raises :class:`IncompleteCheckpointError` if it is missing, not a regular file or
        short, :class:`ChecksumMismatchError` if it is longer."""
        path = self.shard_path(step, record)
        what = f"rank {record.rank} shard {path}"
        self._check_step_dir(step, what)
        with open_regular(path, what) as source:
            size = os.fstat(source.fileno()).st_size
            if size < record.size_bytes:
                raise IncompleteCheckpointError(f"{what}: file is short, {size} of {record.size_bytes} bytes")
            if size > record.size_bytes:
                raise ChecksumMismatchError(f"{what}: file has {size} bytes, the manifest records {record.size_bytes}")
            yield source, what

    def read_shard(
        self, step: int, record: ShardRecord, verify: Verify = "full", into: Mapping[str, np.ndarray] | None = None
    ) -> FlatState:
        """The state in ``record``'s shard, verified against the record (the fast path: block reads
        straight into the arrays, see :func:`~tiered_ckpt.format.shardfile.read_shard_file`).

        With ``into``, fills those arrays instead. The arrays the record lists as replicas
        (held by another rank's shard) are not in the state returned (nor filled in ``into``):
        :func:`~tiered_ckpt.dist.replicas.put_back` adds them.

        Raises :class:`IncompleteCheckpointError` if the file is missing, not a regular file,
        shorter than recorded or cannot be read (an I/O error, chained), :class:`ChecksumMismatchError`
        if it is longer or its bytes differ, :class:`ShardFormatError` if they verify but are not
        a valid shard (or structure document), and :class:`ConfigError` for a ``verify`` other than
        "full" or "fast".
        """
        check_verify(verify)
        replicas, own = own_targets(record.elsewhere, into)
        with self._open_recorded(step, record) as (source, what), _read_errors(what):
            contents = read_shard_file(
                source, check=lambda digest: record.verify(digest, what), verify=verify, what=what, into=own
            )
        record.check_holds(contents.arrays, what)
        return FlatState.from_shard(contents, what, replicas)

    def open_shard(self, step: int, record: ShardRecord, consume: Callable[[BinaryIO], T]) -> T:
        """``consume(stream)`` of ``record``'s shard, a regular file of the recorded size (so the
        stream holds at most ``size_bytes``). Raises :class:`IncompleteCheckpointError` if it is missing,
        not a regular file, short or cannot be read (chained), :class:`ChecksumMismatchError` if longer."""
        with self._open_recorded(step, record) as (source, what), _read_errors(what):
            return consume(source)

    @contextmanager
    def open_ranges(self, step: int, record: ShardRecord) -> Iterator[Callable[[int, memoryview, Verify], str]]:
        """Open ``record``'s shard once for many ranged reads: yields ``read_into(offset, buffer, verify)``,
        :meth:`read_range_into` on the open file. Raises as :meth:`open_shard` does."""
        with self._open_recorded(step, record) as (source, what), _read_errors(what):
            size = record.size_bytes

            def read_into(offset: int, buffer: memoryview, verify: Verify) -> str:
                if offset + len(buffer) > size:
                    raise IncompleteCheckpointError(f"{what}: bytes {offset}-{offset + len(buffer)} are beyond its end")
                return read_hashing(source.fileno(), offset, np.frombuffer(buffer, np.uint8), verify)

            yield read_into

    def read_range_into(
        self, step: int, record: ShardRecord, offset: int, buffer: memoryview, verify: Verify = "full"
    ) -> str:
        """Fill ``buffer`` with the shard's bytes from ``offset``; return their sha256 (``verify="fast"``:
        their xxh3-64). Raises as :meth:`open_ranges` does, and for bytes beyond the shard's end."""
        with self.open_ranges(step, record) as read_into:
            return read_into(offset, buffer, verify)

    def _check_step_dir(self, step: int, what: str) -> None:
        """Raise :class:`IncompleteCheckpointError` if ``step``'s directory (or kept directory) is a
        symbolic link: a manifest (untrusted) naming that step never leads a read outside ``root``."""
        if not self._single and (os.path.islink(self.step_dir(step)) or os.path.islink(self.kept_dir(step))):
            raise IncompleteCheckpointError(f"{what}: its step directory is a symbolic link, not one of {self.root}")

    def check_shard(self, step: int, record: ShardRecord) -> str | None:
        """Hash ``record``'s shard without loading it; the problem (naming the file), or None if it verifies."""
        path = self.shard_path(step, record)
        try:
            self._check_step_dir(step, str(path))
            with open_regular(path, str(path)) as source:
                size = os.fstat(source.fileno()).st_size
                problem = record.mismatch(ShardDigest(size, "", "")) or record.mismatch(hash_stream(source, "full"))
        except IncompleteCheckpointError as exc:
            return str(exc)
        except OSError as exc:
            return f"{path}: read error: {exc.strerror or exc}"
        return f"{path}: {problem}" if problem else None

    def held_ranks(self, step: int, manifest: ShardManifest) -> list[int]:
        """The ranks whose shards committed ``step`` holds here (the rest live on other nodes).

        Every rank unless a multi-process save recorded fewer. A record that does not
        validate against ``manifest`` raises :class:`ManifestError` naming the file.
        """
        return step_records.held_ranks(self.step_dir(step), manifest.world_size)

    def agreement(self, step: int) -> bool | None:
        """Whether the commit of ``step`` was agreed by every rank (see :meth:`commit`); None if no
        valid record says (a step saved before these records existed, or a damaged record)."""
        return step_records.agreement(self.step_dir(step), step)

    def for_every_tier(self, step: int) -> bool:
        """True if ``step`` was committed for every tier whatever its cadence (a preemption's
        stop step, see :meth:`commit`): a replicator resumed after a restart still owes it."""
        return step_records.for_every_tier(self.step_dir(step), step)

    def has_receipt(self, step: int, url: str) -> bool:
        """True if ``step`` has a receipt of its commit at ``url`` (:meth:`write_receipt`)."""
        return step_records.has_receipt(self.step_dir(step), url)

    # -- writing (under the lock) ---------------------------------------------------------

    def new_step_dir(self, step: int) -> Path:
        """The directory of ``step``, created (and made durable) if needed. Temp files in it are
        left alone: another thread of this job may be writing one (a receipt)."""
        self.check_locked()
        directory = self.step_dir(step)
        if not directory.is_dir():
            directory.mkdir(exist_ok=True)  # landers of one step race here: whoever made it, it exists
            fsync_directory(directory.parent)
        return directory

    def clear_temp_files(self, step: int) -> list[str]:
        """Remove what a crashed write left in ``step`` (its writer, before it writes); return the names."""
        self.check_locked()
        return remove_temp_files(self.step_dir(step))

    def land_shard(
        self,
        step: int,
        record: ShardRecord,
        source: ShardSource,
        *,
        deadline: float | None = None,
        sync_directory: bool = True,
        cached: bool = False,
        copy_of: str | None = None,
    ) -> Landed:
        """Write ``source``'s bytes as ``record``'s shard in ``step`` (its directory made if needed),
        atomically: the file appears under its name only once what was written matches the record
        (:class:`ChecksumMismatchError` otherwise, the file there before untouched).

        A ``path`` source is copied (``write`` is preferred when both are given).
        ``sync_directory=False`` leaves the directory's fsync to :meth:`commit`, for many shards
        landed at once; ``cached=True`` writes through the page cache (a refill about to be read
        back). ``copy_of`` names the copy the bytes come from (a bucket's object), for the error
        if they do not match: the copy failed, not this disk (default: the path they land at).
        ``deadline`` is unused (a disk has no transient failures)."""
        del deadline
        path = self.new_step_dir(step) / record.path
        check = partial(record.verify, what=f"rank {record.rank} shard {copy_of or path}")
        self._write(path, source, check, sync_directory=sync_directory, cached=cached)
        return Landed.as_is(record)

    def land_referenced(self, step: int, record: ShardRecord, source: ShardSource, *, copy_of: str) -> None:
        """Land, as :meth:`land_shard` does, ``record``'s file of earlier ``step`` that a step being
        refilled references: in the step's directory if the step is committed here (a repair),
        else in its kept directory, where it stays while a committed step references it
        (:meth:`collect_unreferenced` removes it otherwise, a refill cut short included); a
        damaged copy is replaced where a reader finds it (:meth:`shard_path`)."""
        if self.is_committed(step):
            self.land_shard(step, record, source, cached=True, copy_of=copy_of)
            return
        target = self.shard_path(step, record)
        if not os.path.lexists(target):
            target = self.kept_dir(step) / record.path
            if not target.parent.is_dir():
                target.parent.mkdir()
                fsync_directory(self.root)
        check = partial(record.verify, what=f"rank {record.rank} shard {copy_of}")
        self._write(target, source, check, sync_directory=True, cached=True)

    def write_shard(self, step: int, name: str, source: ShardSource, *, sync_directory: bool = True) -> ShardDigest:
        """Write a shard written here first (the writer serializing a state) as the file ``name`` in
        ``step``, atomically, as :meth:`land_shard` does; nothing is known to check its bytes
        against: the caller builds its record from the digest returned."""
        return self._write(self.new_step_dir(step) / name, source, None, sync_directory=sync_directory, cached=False)

    def _write(
        self,
        path: Path,
        source: ShardSource,
        check: Callable[[ShardDigest], None] | None,
        *,
        sync_directory: bool,
        cached: bool,
    ) -> ShardDigest:
        write = source.write if source.write is not None else partial(_copy_file, source.path)
        digest: ShardDigest = atomic_write(path, write, check=check, sync_directory=sync_directory, direct=not cached)
        return digest

    def commit(
        self,
        manifest: ShardManifest,
        *,
        landed: Sequence[Landed] = (),
        deadline: float | None = None,
        held: Collection[int] | None = None,
        agreed: bool | None = True,
        every_tier: bool = False,
    ) -> None:
        """Commit ``manifest``'s step: its shards (``held`` or all) must have landed here already
        (what their landings returned, ``landed``, says nothing a disk records).

        The step directory is fsynced first (every name landed in it is durable before the
        manifest is), then the records of held ranks, agreement and ``every_tier`` (the step
        goes to every tier, whatever their cadence: :meth:`for_every_tier`), then the manifest.
        ``agreed=False``: every rank is not yet known to have committed it (a multi-process save
        before its agreement, which :meth:`mark_agreed` records): a step no rank marked agreed is
        a save cut short, not a lost disk. None: no record (one process saved every rank).
        """
        del landed, deadline
        self.check_locked()
        directory = self.step_dir(manifest.step)
        fsync_directory(directory)
        self.record_held(manifest.step, manifest, range(manifest.world_size) if held is None else held)
        if agreed is not None:
            step_records.write_agreement(directory, manifest.step, agreed)
        if every_tier:
            step_records.write_every_tier(directory, manifest.step)
        _write_manifest(directory, manifest)

    def mark_agreed(self, step: int) -> None:
        """Record that every rank committed ``step`` (see :meth:`commit`)."""
        self.check_locked()
        step_records.write_agreement(self.step_dir(step), step, True)

    def record_held(self, step: int, manifest: ShardManifest, ranks: Collection[int]) -> None:
        """Durably record that ``step`` holds the shards of ``ranks`` here (every rank: no record)."""
        self.check_locked()
        step_records.write_held(self.step_dir(step), ranks, manifest.world_size)

    def write_receipt(self, step: int, url: str, remote: RemoteManifest) -> None:
        """Record in ``step``'s directory that the step is committed at ``url``."""
        self.check_locked()
        step_records.write_receipt(self.step_dir(step), url, remote.manifest.step, remote.committed_at)

    def delete_step(self, step: int) -> None:
        """Delete ``step``: first make it invisible (its manifest, durably), then its files; a
        step that is not here is no error.

        A crash part-way leaves an uncommitted directory, which :meth:`remove_uncommitted`
        removes on the next start; never a visible checkpoint with missing shards. In
        single-step mode only the checkpoint's own files go (shards, records, temp files).
        """
        self.check_locked()
        directory = self.step_dir(step)
        if not directory.is_dir():
            return
        kept: set[str] | None = set()
        if not self._single:
            referenced = self.referenced_files(skip=step)
            kept = referenced.get(step, set()) if referenced is not None else None
        if kept != set():  # marked before the manifest goes: a crash never leaves them unmarked
            write_bytes(directory / KEPT_NAME, b"{}")
        manifest = directory / MANIFEST_NAME
        if manifest.exists():
            manifest.unlink()
            fsync_directory(directory)
        if kept != set():
            self._remove_all_but(directory, kept)
            self._move_kept(step)
            return
        if self._single:
            for entry in os.scandir(directory):
                if entry.name in step_records.RECORD_NAMES or is_shard_name(entry.name):
                    Path(entry.path).unlink(missing_ok=True)
            remove_temp_files(directory)
            fsync_directory(directory)
            return
        shutil.rmtree(directory)
        fsync_directory(directory.parent)

    def _remove_all_but(self, directory: Path, kept: set[str] | None) -> None:
        """Remove what ``directory`` (a deleted step's) holds but the shard files ``kept`` (None:
        every shard file) and its mark; the directory too once nothing is kept."""
        for entry in os.scandir(directory):
            keep = is_shard_name(entry.name) and (kept is None or entry.name in kept)
            if not keep and entry.name != KEPT_NAME:
                Path(entry.path).unlink(missing_ok=True)
        if kept is not None and not kept.intersection(os.listdir(directory)):
            shutil.rmtree(directory)
            fsync_directory(directory.parent)
        else:
            fsync_directory(directory)

    def _move_kept(self, step: int) -> None:
        """Move deleted ``step``'s directory, holding only kept files, to its kept directory."""
        directory = self.step_dir(step)
        if directory.is_dir() and not self.kept_dir(step).exists():
            os.rename(directory, self.kept_dir(step))
            fsync_directory(self.root)

    def collect_unreferenced(self, *, all_steps: bool = False) -> list[int]:
        """Remove, from the directories of deleted steps, the files no committed step references any
        more (all of a directory once none is), and finish the deletions a crash cut short; return
        the steps whose files all went. ``all_steps`` changes nothing: only this disk's writer and
        restores, which no pass runs beside, put files here."""
        del all_steps
        self.check_locked()
        kept_steps = self.kept_steps()
        if not kept_steps:
            return []
        referenced = self.referenced_files()
        if referenced is None:
            return []
        gone = []
        for step in kept_steps:
            for directory in (self.step_dir(step), self.kept_dir(step)):
                if directory.is_dir() and not (directory / MANIFEST_NAME).exists():
                    self._remove_all_but(directory, referenced.get(step, set()))
            self._move_kept(step)
            if not self.step_dir(step).is_dir() and not self.kept_dir(step).is_dir():
                gone.append(step)
        return gone

    def discard_uncommitted(self, step: int) -> None:
        """Remove ``step``'s files if it was never committed (a failed save)."""
        if self.step_dir(step).is_dir() and not self.is_committed(step):
            self.delete_step(step)

    def remove_uncommitted(self) -> list[str]:
        """Remove what crashed saves left under ``root``; return the names removed.

        Step directories without a manifest are removed whole; temp files are removed from
        ``root`` and from committed step directories. The files of deleted steps that no
        committed step references any more are removed too (:meth:`collect_unreferenced`),
        and not listed. Nothing else is touched.
        """
        self.check_locked()
        root = self.root
        removed = remove_temp_files(root)
        for entry in sorted(os.scandir(root), key=lambda e: e.name):
            if parse_step_dir_name(entry.name) is None or not entry.is_dir(follow_symlinks=False):
                continue
            directory = Path(entry.path)
            if (directory / MANIFEST_NAME).is_file() or (directory / KEPT_NAME).is_file():
                removed += [f"{entry.name}/{name}" for name in remove_temp_files(directory)]
            else:
                shutil.rmtree(directory)
                removed.append(f"{entry.name}/")
        for step in self.collect_unreferenced():  # no crash's leftovers: files nothing references any more
            logger.info("%s: removed the files of step %d no committed step references", root, step)
        if removed:
            fsync_directory(root)
        return removed
