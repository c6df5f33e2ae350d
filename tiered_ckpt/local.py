"""The local tier: atomic, durable writes and verified reads of checkpoint files on disk.

An atomic write, step by step:

1. create ``.<name>.<random>.tmp`` in the target directory (never an existing file);
2. write the bytes, then ``fsync`` the file;
3. ``os.replace`` it onto its final name;
4. ``fsync`` the directory, so the rename itself survives a power cut (callers that
   rename many files do this once, after the last one).

A checkpoint directory is committed exactly when its ``manifest.json`` exists, and the
manifest is written only after every shard it names is durable under its final name.
"""

from __future__ import annotations

import ctypes
import fcntl
import io
import json
import os
import shutil
import sys
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, TypeVar

import numpy as np

from .errors import (
    ChecksumMismatchError,
    DirectoryInUseError,
    IncompleteCheckpointError,
    ManifestError,
)
from .layout import HELD_NAME, MANIFEST_NAME, is_temp_name, parse_step_dir_name, temp_name, temp_target
from .manifest import MAX_MANIFEST_BYTES, ShardManifest, ShardRecord
from .shardfile import ShardDigest, Verify, hash_stream, read_shard, write_all, write_shard

__all__ = [
    "fsync_directory",
    "atomic_write",
    "remove_temp_files",
    "directory_lock",
    "write_shard_file",
    "read_shard_file",
    "check_shard_file",
    "commit_manifest",
    "read_manifest",
    "is_committed",
    "held_ranks",
    "record_held_ranks",
    "committed_steps",
    "delete_checkpoint",
    "remove_uncommitted",
]

T = TypeVar("T")

# Start writing dirty pages back after every 8 MiB, so the disk works while the CPU
# hashes the next chunk instead of idling until the final fsync. The os module has
# no sync_file_range, so it is called through libc (Linux only; a no-op elsewhere).
WRITEBACK_BYTES = 8 << 20
_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    function = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        function.restype = ctypes.c_int
    return function


_sync_file_range = _load_sync_file_range()


class _EagerWriteback(io.RawIOBase):
    """A write-only raw file that asks the kernel to start writeback as it goes.

    It only starts writeback early; durability still comes from the final fsync.
    """

    def __init__(self, raw: io.FileIO) -> None:
        super().__init__()
        self._raw = raw
        self._position = 0
        self._flushed_to = 0

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._raw.fileno()

    def write(self, data) -> int:  # type: ignore[override]
        written = self._raw.write(data) or 0
        self._position += written
        if _sync_file_range is not None and self._position - self._flushed_to >= WRITEBACK_BYTES:
            # Best effort: a failure here shows up again, and is raised, at fsync.
            _sync_file_range(
                self._raw.fileno(), self._flushed_to, self._position - self._flushed_to, _SYNC_FILE_RANGE_WRITE
            )
            self._flushed_to = self._position
        return written


def fsync_directory(directory: Path) -> None:
    """Make the directory's entries (renames, creations, deletions) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(
    path: Path,
    write: Callable[[BinaryIO], T],
    *,
    sync_directory: bool = True,
    check: Callable[[T], None] | None = None,
) -> T:
    """Write ``path`` through a temp file so that it holds either its old content or all of the new.

    ``write`` receives an unbuffered binary file. ``check``, if given, receives what
    ``write`` returned and may raise to refuse the content. On success the file is
    fsynced and renamed onto ``path`` (and the directory fsynced unless
    ``sync_directory`` is False, for callers that fsync it once after many renames).
    On any failure the temp file is removed and ``path`` is untouched.
    """
    temp = path.with_name(temp_name(path.name))
    with open(temp, "xb", buffering=0) as out:
        try:
            result = write(_EagerWriteback(out))
            if check is not None:
                check(result)
            os.fsync(out.fileno())
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
    try:
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    if sync_directory:
        fsync_directory(path.parent)
    return result


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
def directory_lock(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``directory`` against other saves, in any process.

    Raises :class:`DirectoryInUseError` at once if another holder has it.
    """
    # flock on the directory itself: no lock file is left among the checkpoint's files.
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DirectoryInUseError(f"{directory}: in use by another save or CheckpointManager") from None
        yield
    finally:
        os.close(fd)


def write_shard_file(path: Path, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> ShardDigest:
    """Atomically write one shard file at ``path``; the directory fsync is left to the caller."""
    return atomic_write(path, lambda out: write_shard(out, arrays, metadata), sync_directory=False)


def _describe(record: ShardRecord, path: Path) -> str:
    return f"rank {record.rank} shard {path}"


def read_shard_file(
    directory: Path,
    record: ShardRecord,
    verify: Verify = "full",
    into: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Return the arrays of ``record``'s shard in ``directory``, verified against the record.

    With ``into``, fills those arrays instead (see :func:`~tiered_ckpt.shardfile.read_shard`).

    Raises :class:`IncompleteCheckpointError` if the file is missing or shorter than
    recorded, :class:`ChecksumMismatchError` if it is longer or its bytes differ.
    """
    path = directory / record.path
    what = _describe(record, path)
    try:
        source = open(path, "rb", buffering=0)
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{what}: file is missing") from None
    with source:
        size = os.fstat(source.fileno()).st_size
        if size < record.size_bytes:
            raise IncompleteCheckpointError(f"{what}: file is short, {size} of {record.size_bytes} bytes")
        if size > record.size_bytes:
            raise ChecksumMismatchError(f"{what}: file has {size} bytes, the manifest records {record.size_bytes}")
        expected = ShardDigest(record.size_bytes, record.sha256, record.xxh3_64)
        return read_shard(source, expected=expected, verify=verify, what=what, into=into)


def check_shard_file(directory: Path, record: ShardRecord) -> str | None:
    """Hash a shard file against its record without loading it; return the problem, or None if it verifies."""
    path = directory / record.path
    try:
        with open(path, "rb", buffering=0) as source:
            size = os.fstat(source.fileno()).st_size
            if size != record.size_bytes:
                return f"{path}: {size} bytes, the manifest records {record.size_bytes}"
            digest = hash_stream(source, "full")
    except FileNotFoundError:
        return f"{path}: missing"
    if digest.sha256 != record.sha256:
        return f"{path}: sha256 is {digest.sha256}, the manifest records {record.sha256}"
    return None


def commit_manifest(directory: Path, manifest: ShardManifest) -> None:
    """Commit the checkpoint in ``directory`` by durably writing its manifest.

    Call only once every shard the manifest names is durable under its final name.
    """
    data = manifest.to_json().encode()
    atomic_write(directory / MANIFEST_NAME, lambda out: write_all(out, data))


def is_committed(directory: Path) -> bool:
    """True if ``directory`` holds a manifest (validity is checked by :func:`read_manifest`)."""
    return (directory / MANIFEST_NAME).is_file()


def read_manifest(directory: Path) -> ShardManifest:
    """Read and strictly validate the manifest of the checkpoint in ``directory``.

    Raises :class:`IncompleteCheckpointError` if there is none (the checkpoint was
    never committed) and :class:`ManifestError` if it does not validate.
    """
    path = directory / MANIFEST_NAME
    try:
        with open(path, "rb") as source:
            data = source.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{directory}: no {MANIFEST_NAME}, the checkpoint was never committed"
        ) from None
    except IsADirectoryError:
        raise ManifestError(f"{path}: is a directory, not a manifest") from None
    return ShardManifest.from_json(data, source=str(path))


def held_ranks(directory: Path, manifest: ShardManifest) -> list[int]:
    """The ranks whose shards the committed step in ``directory`` holds (the rest live on other nodes).

    Every rank unless a multi-process save recorded fewer. A record that does not
    validate against ``manifest`` raises :class:`ManifestError` naming the file.
    """
    path = directory / HELD_NAME
    try:
        document = json.loads(path.read_bytes())
    except FileNotFoundError:
        return list(range(manifest.world_size))
    except (OSError, ValueError) as exc:
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
    atomic_write(path, lambda out: write_all(out, data))


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
