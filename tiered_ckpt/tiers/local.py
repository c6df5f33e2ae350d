"""The local tier: checkpoints in step directories on this node's disk.

A checkpoint directory is committed exactly when its ``manifest.json`` exists, and the
manifest is written (atomically, see :mod:`tiered_ckpt.durable`) only after every shard
it names is durable under its final name. Deleting one removes the manifest first.

Reads treat what is on disk as untrusted: a shard is opened only if it is a regular
file (never a symlink, a FIFO or a device, which could lead outside the checkpoint or
block forever), its size is checked before it is mapped, and its bytes are hashed
before they are returned. :class:`LocalTier` holds a directory for a running job: its
lock, its steps, and the receipts of their remote commits.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import stat
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager
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
    AGREEMENT_NAME,
    HELD_NAME,
    MANIFEST_NAME,
    RECEIPT_NAME,
    parse_step_dir_name,
    step_dir_name,
)
from tiered_ckpt.format.manifest import MAX_MANIFEST_BYTES, RemoteManifest, ShardManifest, ShardRecord
from tiered_ckpt.format.shardfile import read_shard, write_shard
from tiered_ckpt.format.state import FlatState
from tiered_ckpt.io.durable import atomic_write, fsync_directory, is_temp_name, temp_target, write_bytes
from tiered_ckpt.io.hashing import ShardDigest, Verify, check_verify, hash_stream, read_hashing

__all__ = [
    "LocalTier",
    "fsync_directory",
    "atomic_write",
    "remove_temp_files",
    "directory_lock",
    "write_shard_file",
    "read_shard_file",
    "open_shard_ranges",
    "check_shard_file",
    "commit_manifest",
    "read_manifest",
    "is_committed",
    "held_ranks",
    "record_held_ranks",
    "read_agreement",
    "record_agreement",
    "committed_steps",
    "delete_checkpoint",
    "remove_uncommitted",
    "read_receipt",
    "write_receipt",
]

T = TypeVar("T")


def remove_temp_files(directory: Path, targets: Collection[str] | None = None) -> list[str]:
    """Remove temp files a crashed write left in ``directory``; return their names.

    With ``targets``, only temp files meant to become one of those names are removed.
    """
    removed = []
    for entry in os.scandir(directory):
        if is_temp_name(entry.name) and (targets is None or temp_target(entry.name) in targets):
            Path(entry.path).unlink(missing_ok=True)
            removed.append(entry.name)
    return sorted(removed)


@contextmanager
def directory_lock(directory: Path) -> Iterator[tuple[int, int]]:
    """Hold an exclusive lock on ``directory`` against other saves, in any process.

    Yields the locked directory's (device, inode). Raises :class:`DirectoryInUseError`
    at once if another holder has it.
    """
    # flock on the directory itself: no lock file is left among the checkpoint's files.
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DirectoryInUseError(f"{directory}: in use by another save or CheckpointManager") from None
        locked = os.fstat(fd)
        yield locked.st_dev, locked.st_ino
    finally:
        os.close(fd)


def write_shard_file(
    path: Path, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str], *, part_digests: bool = False
) -> ShardDigest:
    """Atomically write one shard file at ``path``; the directory fsync is left to the caller."""
    write = lambda out: write_shard(out, arrays, metadata, part_digests=part_digests)  # noqa: E731
    return atomic_write(path, write, sync_directory=False)


def _open_regular(path: Path, what: str) -> BinaryIO:
    """Open ``path`` for reading only if it is a regular file (not a symlink, FIFO, device or directory).

    Raises :class:`IncompleteCheckpointError` naming ``what`` otherwise: such a file is
    not the shard that was committed, and opening a FIFO would block forever.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{what}: file is missing") from None
    except OSError as exc:
        problem = "is a symbolic link" if exc.errno == errno.ELOOP else f"cannot be opened: {exc.strerror}"
        raise IncompleteCheckpointError(f"{what}: {problem}, not the committed file") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "is a directory" if stat.S_ISDIR(mode) else f"is not a regular file (mode {stat.filemode(mode)})"
        raise IncompleteCheckpointError(f"{what}: {kind}, not the committed file")
    os.set_blocking(fd, True)
    return open(fd, "rb", buffering=0)


def _read_small(path: Path, limit: int = MAX_MANIFEST_BYTES) -> bytes:
    """The bytes of a small regular file (a manifest, a record); never more than the file
    holds, and nothing of a file over ``limit`` bytes (:class:`ManifestError`)."""
    with _open_regular(path, str(path)) as source:
        size = os.fstat(source.fileno()).st_size
        if size > limit:
            raise ManifestError(f"{path}: {size} bytes, over the {limit} byte limit of a manifest or record")
        return source.read(size + 1)


def _describe(record: ShardRecord, path: Path) -> str:
    return f"rank {record.rank} shard {path}"


@contextmanager
def _open_recorded(directory: Path, record: ShardRecord) -> Iterator[tuple[BinaryIO, str]]:
    """Open ``record``'s shard in ``directory``, a regular file of the recorded size; yields it
    and its description for errors. Raises :class:`IncompleteCheckpointError` if it is missing,
    not a regular file or short, :class:`ChecksumMismatchError` if it is longer."""
    path = directory / record.path
    what = _describe(record, path)
    with _open_regular(path, what) as source:
        size = os.fstat(source.fileno()).st_size
        if size < record.size_bytes:
            raise IncompleteCheckpointError(f"{what}: file is short, {size} of {record.size_bytes} bytes")
        if size > record.size_bytes:
            raise ChecksumMismatchError(f"{what}: file has {size} bytes, the manifest records {record.size_bytes}")
        yield source, what


def read_shard_file(
    directory: Path,
    record: ShardRecord,
    verify: Verify = "full",
    into: Mapping[str, np.ndarray] | None = None,
) -> FlatState:
    """Return the state in ``record``'s shard in ``directory``, verified against the record.

    With ``into``, fills those arrays instead (see :func:`~tiered_ckpt.shardfile.read_shard`).
    The arrays the record lists as replicas (held by another rank's shard) are not in the
    state returned (nor filled in ``into``): :func:`~tiered_ckpt.replicas.put_back` adds them.

    Raises :class:`IncompleteCheckpointError` if the file is missing, not a regular file,
    shorter than recorded or cannot be read (an I/O error, chained), :class:`ChecksumMismatchError`
    if it is longer or its bytes differ, :class:`ShardFormatError` if they verify but are not
    a valid shard (or structure document), and :class:`ConfigError` for a ``verify`` other than "full" or "fast".
    """
    check_verify(verify)
    elsewhere = {name for name, _holder in record.replicas}
    held = {name: array for name, array in into.items() if name not in elsewhere} if into is not None else None
    with _open_recorded(directory, record) as (source, what), _read_errors(what):
        contents = read_shard(
            source, check=lambda digest: record.verify(digest, what), verify=verify, what=what, into=held
        )
    return FlatState.from_shard(contents, what, elsewhere)


@contextmanager
def _read_errors(what: str) -> Iterator[None]:
    """Raise an OSError of reading a shard (EIO from a failing disk) as :class:`IncompleteCheckpointError`
    naming ``what``, the OSError chained: the copy cannot be read, and the store then tries the next tier."""
    try:
        yield
    except OSError as exc:
        raise IncompleteCheckpointError(f"{what}: read error: {exc.strerror or exc}") from exc


@contextmanager
def open_shard_ranges(directory: Path, record: ShardRecord) -> Iterator[Callable[[int, memoryview, Verify], str]]:
    """Open ``record``'s shard in ``directory`` for reading parts: yields ``read_into(offset, buffer, verify)``,
    which fills ``buffer`` with the file's bytes from ``offset`` and returns their sha256
    (``verify="fast"``: their xxh3-64).

    Raises :class:`IncompleteCheckpointError` if the file is missing, not a regular file,
    short or cannot be read (an I/O error, chained), :class:`ChecksumMismatchError` if it is longer than recorded.
    """
    with _open_recorded(directory, record) as (source, what), _read_errors(what):
        size = record.size_bytes

        def read_into(offset: int, buffer: memoryview, verify: Verify) -> str:
            if offset + len(buffer) > size:
                raise IncompleteCheckpointError(f"{what}: bytes {offset}-{offset + len(buffer)} are beyond its end")
            return read_hashing(source.fileno(), offset, np.frombuffer(buffer, np.uint8), verify)

        yield read_into


def check_shard_file(directory: Path, record: ShardRecord) -> str | None:
    """Hash a shard file against its record without loading it; return the problem, or None if it verifies."""
    path = directory / record.path
    try:
        with _open_regular(path, str(path)) as source:
            size = os.fstat(source.fileno()).st_size
            problem = record.mismatch(ShardDigest(size, "", "")) or record.mismatch(hash_stream(source, "full"))
    except IncompleteCheckpointError as exc:
        return str(exc)
    except OSError as exc:
        return f"{path}: read error: {exc.strerror or exc}"
    return f"{path}: {problem}" if problem else None


def commit_manifest(directory: Path, manifest: ShardManifest) -> None:
    """Commit the checkpoint in ``directory`` by durably writing its manifest.

    Call only once every shard the manifest names is durable under its final name.
    """
    write_bytes(directory / MANIFEST_NAME, manifest.to_json().encode())


def is_committed(directory: Path) -> bool:
    """True if ``directory`` holds a manifest (validity is checked by :func:`read_manifest`)."""
    return (directory / MANIFEST_NAME).is_file()


def read_manifest(directory: Path) -> ShardManifest:
    """Read and strictly validate the manifest of the checkpoint in ``directory``.

    Raises :class:`IncompleteCheckpointError` if there is none (the checkpoint was
    never committed) and :class:`ManifestError` if it does not validate. Reads only
    what the file holds, and nothing of a file over the manifest size limit.
    """
    path = directory / MANIFEST_NAME
    try:
        data = _read_small(path)
    except IncompleteCheckpointError as exc:
        if not os.path.lexists(path):
            raise IncompleteCheckpointError(
                f"{directory}: no {MANIFEST_NAME}, the checkpoint was never committed"
            ) from None
        raise ManifestError(str(exc)) from None
    return ShardManifest.from_json(data, source=str(path))


def held_ranks(directory: Path, manifest: ShardManifest) -> list[int]:
    """The ranks whose shards the committed step in ``directory`` holds (the rest live on other nodes).

    Every rank unless a multi-process save recorded fewer. A record that does not
    validate against ``manifest`` raises :class:`ManifestError` naming the file.
    """
    path = directory / HELD_NAME
    if not os.path.lexists(path):
        return list(range(manifest.world_size))
    try:
        document = json.loads(_read_small(path))
    except (IncompleteCheckpointError, OSError, ValueError) as exc:
        raise ManifestError(f"{path}: not a readable JSON record of held shards: {exc}") from exc
    ranks = document.get("ranks") if isinstance(document, dict) and set(document) == {"ranks"} else None
    if not isinstance(ranks, list) or not all(type(rank) is int and 0 <= rank < manifest.world_size for rank in ranks):
        raise ManifestError(f'{path}: expected {{"ranks": [ranks below {manifest.world_size}]}}, got {document!r}')
    return sorted(set(ranks))


def record_held_ranks(directory: Path, manifest: ShardManifest, ranks: Collection[int]) -> None:
    """Durably record that ``directory`` holds the shards of ``ranks`` of ``manifest``'s step.

    For a new step, call it before :func:`commit_manifest`. Holding every rank needs
    no record (and removes one).
    """
    path = directory / HELD_NAME
    if set(ranks) >= set(range(manifest.world_size)):
        if path.exists():
            path.unlink()
            fsync_directory(directory)
        return
    data = json.dumps({"ranks": sorted(set(ranks))}).encode()
    write_bytes(path, data)


def record_agreement(directory: Path, step: int, agreed: bool) -> None:
    """Durably record whether every rank is known to have committed ``step`` in ``directory``.

    A multi-process save records ``agreed=False`` before its manifest and ``True`` once the
    ranks agreed that every one of them committed: a step some ranks hold, and none marked
    agreed, is a save cut short (never restorable), not a step a node's disk lost.
    """
    write_bytes(directory / AGREEMENT_NAME, json.dumps({"step": step, "agreed": agreed}).encode())


def read_agreement(directory: Path, step: int) -> bool | None:
    """Whether the commit of ``step`` in ``directory`` was agreed by every rank; None if no valid
    record says (a step saved before these records existed, or a damaged record)."""
    try:
        document = json.loads(_read_small(directory / AGREEMENT_NAME))
    except (CheckpointError, OSError, ValueError):
        return None
    if not isinstance(document, dict) or document.get("step") != step or type(document.get("agreed")) is not bool:
        return None
    return bool(document["agreed"])


def committed_steps(root: Path) -> list[int]:
    """Steps under ``root`` whose step directory holds a manifest, oldest first."""
    if not root.is_dir():
        return []
    steps = []
    for entry in os.scandir(root):
        step = parse_step_dir_name(entry.name)
        if step is not None and entry.is_dir(follow_symlinks=False) and is_committed(Path(entry.path)):
            steps.append(step)
    return sorted(steps)


def delete_checkpoint(directory: Path) -> None:
    """Delete a checkpoint: first make it invisible (its manifest, durably), then its files.

    A crash part-way leaves an uncommitted directory, which :func:`remove_uncommitted`
    removes on the next start; never a visible checkpoint with missing shards.
    """
    manifest = directory / MANIFEST_NAME
    if manifest.exists():
        manifest.unlink()
        fsync_directory(directory)
    shutil.rmtree(directory)
    fsync_directory(directory.parent)


def remove_uncommitted(root: Path) -> list[str]:
    """Remove what crashed saves left under ``root``; return the names removed.

    Step directories without a manifest are removed whole; temp files are removed from
    ``root`` and from committed step directories. Nothing else is touched.
    """
    removed = [f"{name}" for name in remove_temp_files(root)]
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if parse_step_dir_name(entry.name) is None or not entry.is_dir(follow_symlinks=False):
            continue
        directory = Path(entry.path)
        if is_committed(directory):
            removed += [f"{entry.name}/{name}" for name in remove_temp_files(directory)]
        else:
            shutil.rmtree(directory)
            removed.append(f"{entry.name}/")
    if removed:
        fsync_directory(root)
    return removed


def write_receipt(directory: Path, url: str, remote: RemoteManifest) -> None:
    """Record in a local step directory that the step is committed at ``url``."""
    data = json.dumps({"url": url, "step": remote.manifest.step, "committed_at": remote.committed_at}).encode()
    write_bytes(directory / RECEIPT_NAME, data)


def read_receipt(directory: Path, url: str) -> bool:
    """True if the step in ``directory`` has a receipt of its commit at ``url``."""
    try:
        document = json.loads(_read_small(directory / RECEIPT_NAME))
    except (CheckpointError, OSError, ValueError):
        return False
    return isinstance(document, dict) and document.get("url") == url


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
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._locked: tuple[int, int] | None = None

    def __repr__(self) -> str:
        return f"LocalTier({str(self.root)!r})"

    def step_dir(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold ``root`` (created if needed) for one writer; see :func:`directory_lock`.

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

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return committed_steps(self.root)

    def staged_steps(self) -> list[int]:
        """Step directories without a manifest: being written, or left by a crash."""
        if not self.root.is_dir():
            return []
        steps = [parse_step_dir_name(entry.name) for entry in os.scandir(self.root) if entry.is_dir()]
        return sorted(step for step in steps if step is not None and not is_committed(self.step_dir(step)))

    def manifest(self, step: int) -> ShardManifest:
        """The validated manifest of committed ``step``; one that names another step is refused."""
        manifest = read_manifest(self.step_dir(step))
        if manifest.step != step:
            raise ManifestError(
                f"{self.step_dir(step) / MANIFEST_NAME}: field 'step' is {manifest.step}, the directory is step {step}"
            )
        return manifest

    def read_shard(
        self, step: int, record: ShardRecord, verify: Verify = "full", into: Mapping[str, np.ndarray] | None = None
    ) -> FlatState:
        return read_shard_file(self.step_dir(step), record, verify, into)

    def open_ranges(
        self, step: int, record: ShardRecord
    ) -> AbstractContextManager[Callable[[int, memoryview, Verify], str]]:
        return open_shard_ranges(self.step_dir(step), record)

    def check_shard(self, step: int, record: ShardRecord) -> str | None:
        return check_shard_file(self.step_dir(step), record)

    def shard_path(self, step: int, record: ShardRecord) -> Path:
        return self.step_dir(step) / record.path

    def held_ranks(self, step: int, manifest: ShardManifest) -> list[int]:
        return held_ranks(self.step_dir(step), manifest)

    def has_receipt(self, step: int, url: str) -> bool:
        return read_receipt(self.step_dir(step), url)

    def agreement(self, step: int) -> bool | None:
        """See :func:`read_agreement`."""
        return read_agreement(self.step_dir(step), step)

    # -- writing (under the lock) ---------------------------------------------------------

    def remove_uncommitted(self) -> list[str]:
        self.check_locked()
        return remove_uncommitted(self.root)

    def new_step_dir(self, step: int) -> Path:
        """The directory of ``step``, created (and made durable) if needed."""
        self.check_locked()
        directory = self.step_dir(step)
        if not directory.is_dir():
            directory.mkdir()
            fsync_directory(self.root)
        return directory

    def land_shard(self, step: int, record: ShardRecord, write: Callable[[BinaryIO], ShardDigest]) -> None:
        """Write ``record``'s shard into ``step`` atomically: it appears only if what ``write``
        wrote (and returned the digest of) matches the record."""
        self.check_locked()
        path = self.shard_path(step, record)
        atomic_write(path, write, check=lambda digest: record.verify(digest, _describe(record, path)))

    def commit(self, manifest: ShardManifest, held: Collection[int] | None = None, *, agreed: bool = True) -> None:
        """Commit ``manifest``'s step (its shards, ``held`` or all, must be durable here already).

        ``agreed=False``: every rank is not yet known to have committed it (a multi-process
        save, before its agreement; :meth:`mark_agreed` records it once made).
        """
        self.check_locked()
        directory = self.step_dir(manifest.step)
        record_held_ranks(directory, manifest, range(manifest.world_size) if held is None else held)
        record_agreement(directory, manifest.step, agreed)
        commit_manifest(directory, manifest)

    def mark_agreed(self, step: int) -> None:
        """Record that every rank committed ``step`` (see :func:`record_agreement`)."""
        self.check_locked()
        record_agreement(self.step_dir(step), step, True)

    def record_held(self, step: int, manifest: ShardManifest, ranks: Collection[int]) -> None:
        self.check_locked()
        record_held_ranks(self.step_dir(step), manifest, ranks)

    def write_receipt(self, step: int, url: str, remote: RemoteManifest) -> None:
        self.check_locked()
        write_receipt(self.step_dir(step), url, remote)

    def delete(self, step: int) -> None:
        self.check_locked()
        delete_checkpoint(self.step_dir(step))

    def discard_uncommitted(self, step: int) -> None:
        """Remove ``step``'s directory if it was never committed (a failed save)."""
        directory = self.step_dir(step)
        if directory.is_dir() and not is_committed(directory):
            self.check_locked()
            shutil.rmtree(directory)
