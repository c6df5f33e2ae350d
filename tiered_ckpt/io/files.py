"""Files on this node's disk that a reader must not trust, and a directory one writer holds.

What is on disk may not be what was written: a file can be swapped for a symlink (leading
outside the checkpoint), a FIFO or a device (blocking a reader forever), or grow past any
size a reader should load. :func:`open_regular` opens only regular files and
:func:`read_small` reads a small one with a limit. :func:`directory_lock` keeps a second
writer out of a directory, and :func:`remove_temp_files` clears what a crashed atomic
write (:mod:`~tiered_ckpt.io.durable`) left.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from tiered_ckpt.errors import DirectoryInUseError, IncompleteCheckpointError, ManifestError
from tiered_ckpt.io.durable import is_temp_name, temp_target

__all__ = ["directory_lock", "open_regular", "pread_exactly", "read_small", "remove_temp_files"]


def open_regular(path: Path, what: str) -> BinaryIO:
    """Open ``path`` for reading only if it is a regular file (not a symlink, FIFO, device or directory).

    Raises :class:`IncompleteCheckpointError` naming ``what`` otherwise: such a file is
    not the one that was committed, and opening a FIFO would block forever.
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


def pread_exactly(fd: int, buffer: memoryview, offset: int) -> None:
    """Fill ``buffer`` (a contiguous byte view) with the bytes of the open file ``fd`` from
    ``offset``. With ``pread``, not through a map: a failing disk raises OSError (EIO), which
    the caller can answer, where a mapped page would kill the process with SIGBUS. A file
    that ends before ``buffer`` is full raises OSError (EIO) too."""
    got = 0
    while got < buffer.nbytes:
        count = os.preadv(fd, [buffer[got:]], offset + got)
        if count == 0:
            raise OSError(errno.EIO, f"file ended at byte {offset + got}")
        got += count


def read_small(path: Path, limit: int) -> bytes:
    """The bytes of a small regular file (a manifest, a record); never more than the file
    holds, and nothing of a file over ``limit`` bytes (:class:`ManifestError`)."""
    with open_regular(path, str(path)) as source:
        size = os.fstat(source.fileno()).st_size
        if size > limit:
            raise ManifestError(f"{path}: {size} bytes, over the {limit} byte limit of a manifest or record")
        return source.read(size + 1)


@contextmanager
def directory_lock(directory: Path) -> Iterator[tuple[int, int]]:
    """Hold an exclusive lock on ``directory`` against other writers, in any process.

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


def remove_temp_files(directory: Path, targets: Collection[str] | None = None) -> list[str]:
    """Remove temp files a crashed write left in ``directory``; return their names, sorted.

    With ``targets``, only temp files meant to become one of those names are removed.
    """
    removed = []
    for entry in os.scandir(directory):
        if is_temp_name(entry.name) and (targets is None or temp_target(entry.name) in targets):
            Path(entry.path).unlink(missing_ok=True)
            removed.append(entry.name)
    return sorted(removed)
