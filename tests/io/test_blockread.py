"""Tests of blockread.py: a file read front to back in blocks, by a thread of its own that lets
what it read go from the page cache behind it, unless the file is already in it."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from pathlib import Path

import pytest

from tiered_ckpt.io import blockread
from tiered_ckpt.io.blockread import BLOCK_BYTES, read_blocks

SIZES = [0, 1, 4095, 4096, BLOCK_BYTES - 1, BLOCK_BYTES, BLOCK_BYTES + 1, 3 * BLOCK_BYTES + 777]


def _write(path: Path, size: int) -> bytes:
    data = hashlib.shake_256(str(size).encode()).digest(size) if size else b""
    path.write_bytes(data)
    return data


def _evict(path: Path) -> None:
    """Drop the file's (clean) pages from the page cache, so the next read comes from disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read_all(path: Path, size: int | None = None) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        with read_blocks(fd, os.fstat(fd).st_size if size is None else size) as blocks:
            return b"".join(bytes(view) for view in blocks)
    finally:
        os.close(fd)


def _reader_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "tiered-ckpt-read"]


@pytest.mark.parametrize("cached", [True, False])
@pytest.mark.parametrize("size", SIZES)
def test_every_byte_comes_back_in_order(tmp_path: Path, size: int, cached: bool) -> None:
    data = _write(tmp_path / "file", size)
    if not cached:
        _evict(tmp_path / "file")
    assert _read_all(tmp_path / "file") == data
    assert not _reader_threads()


@pytest.mark.parametrize("cached", [True, False])
def test_a_file_shorter_than_expected_raises(tmp_path: Path, cached: bool) -> None:
    _write(tmp_path / "short", BLOCK_BYTES + 10)
    if not cached:
        _evict(tmp_path / "short")
    with pytest.raises(OSError, match="file ended at byte"):
        _read_all(tmp_path / "short", size=BLOCK_BYTES + 4096 * 3)
    assert not _reader_threads()


def test_leaving_early_stops_the_thread(tmp_path: Path) -> None:
    _write(tmp_path / "file", 8 * BLOCK_BYTES)
    _evict(tmp_path / "file")
    fd = os.open(tmp_path / "file", os.O_RDONLY)
    try:
        with read_blocks(fd, 8 * BLOCK_BYTES) as blocks:
            first = bytes(next(iter(blocks)))
    finally:
        os.close(fd)
    assert len(first) == BLOCK_BYTES
    assert not _reader_threads()


def _is_cached(path: Path, offset: int = 0) -> bool:
    """Whether the page cache holds the block at ``offset`` (asking starts readahead there)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.preadv(fd, [bytearray(BLOCK_BYTES)], offset, os.RWF_NOWAIT) == BLOCK_BYTES
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.mark.parametrize("cached", [True, False])
def test_only_an_uncached_file_is_read_ahead_and_let_go_from_the_page_cache(tmp_path, monkeypatch, cached) -> None:
    path = tmp_path / "file"
    data = _write(path, 4 * BLOCK_BYTES)
    if not cached:
        _evict(path)
    assert _is_cached(path) == cached
    readers = []
    real_reader = blockread._Reader

    def counted_reader(*args):
        readers.append(args)
        return real_reader(*args)

    monkeypatch.setattr(blockread, "_Reader", counted_reader)
    assert _read_all(path) == data
    assert len(readers) == (0 if cached else 1)
    assert _is_cached(path, offset=2 * BLOCK_BYTES) == cached


def test_a_long_read_lets_go_of_what_it_read_as_it_moves_on(tmp_path: Path) -> None:
    """Not only at its end: the cache holds a few MiB of the file at a time, whatever its size."""
    path = tmp_path / "file"
    data = _write(path, 24 * BLOCK_BYTES)
    _evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        with read_blocks(fd, len(data)) as blocks:
            taken = []
            for view in blocks:
                taken.append(bytes(view))
                if len(taken) == 20:  # the thread has read 20 blocks or more, and let the first 8 go
                    assert not _is_cached(path, offset=0)
    finally:
        os.close(fd)
    assert b"".join(taken) == data


def test_a_file_system_that_cannot_tell_what_it_caches_is_read_through_a_map(tmp_path, monkeypatch) -> None:
    """tmpfs answers a read that must not wait with EOPNOTSUPP: its files are memory already."""
    real_preadv = os.preadv

    def preadv(fd, buffers, offset, *flags):
        if flags and flags[0] & os.RWF_NOWAIT:
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real_preadv(fd, buffers, offset, *flags)

    monkeypatch.setattr(blockread.os, "preadv", preadv)
    readers = []
    monkeypatch.setattr(blockread, "_Reader", lambda *args: readers.append(args))
    data = _write(tmp_path / "file", 2 * BLOCK_BYTES + 5)
    _evict(tmp_path / "file")
    assert _read_all(tmp_path / "file") == data and readers == []
