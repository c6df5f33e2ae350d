"""Tests of durable.py: atomic writes staged in aligned blocks, written by a thread of their
own, bypassing the page cache where the file system allows it."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiered_ckpt.io import durable
from tiered_ckpt.io.durable import BLOCK_BYTES, atomic_write, observe_writes, write_all, write_bytes

SIZES = [0, 1, 4095, 4096, BLOCK_BYTES - 1, BLOCK_BYTES, BLOCK_BYTES + 1, 3 * BLOCK_BYTES + 12345, 7 * BLOCK_BYTES]


def _payload(size: int) -> bytes:
    return hashlib.shake_256(str(size).encode()).digest(size) if size else b""


def _write_pieces(data: bytes, pieces: list[int]):
    def write(out):
        start = 0
        for size in pieces:
            write_all(out, data[start : start + size])
            start += size
        write_all(out, data[start:])

    return write


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("size", SIZES)
def test_atomic_write_holds_every_byte(tmp_path: Path, size: int, direct: bool) -> None:
    data = _payload(size)
    atomic_write(tmp_path / "file", lambda out: write_all(out, data), direct=direct)
    assert (tmp_path / "file").read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(st.integers(0, 2 * BLOCK_BYTES + 7), max_size=8), direct=st.booleans())
def test_any_split_of_the_writes_gives_the_same_file(tmp_path: Path, pieces: list[int], direct: bool) -> None:
    data = _payload(sum(pieces) + 5)
    path = tmp_path / "split"
    atomic_write(path, _write_pieces(data, pieces), direct=direct)
    assert path.read_bytes() == data


def test_the_observer_sees_every_byte_in_order(tmp_path: Path) -> None:
    data = _payload(2 * BLOCK_BYTES + 999)
    seen = hashlib.sha256()
    calls = []

    def write(out):
        assert observe_writes(out, seen.update)
        write_all(out, data[:100])
        calls.append(seen.copy().hexdigest())  # observed by the time write() returned
        write_all(out, data[100:])

    atomic_write(tmp_path / "observed", write)
    assert calls == [hashlib.sha256(data[:100]).hexdigest()]
    assert seen.hexdigest() == hashlib.sha256(data).hexdigest()


def test_observe_writes_declines_other_files() -> None:
    seen = []
    out = io.BytesIO()
    assert not observe_writes(out, seen.append)
    out.write(b"abc")
    assert seen == []


def test_full_blocks_bypass_the_page_cache_where_the_file_system_allows(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT)
    try:
        if not durable._set_direct(fd, True):
            pytest.skip("this file system refuses O_DIRECT")
    finally:
        os.close(fd)
        os.unlink(tmp_path / "probe")
    flags = []

    def write(out):
        write_all(out, _payload(2 * BLOCK_BYTES))
        flags.append(fcntl.fcntl(out.fileno(), fcntl.F_GETFL))

    atomic_write(tmp_path / "direct", write)
    assert flags[0] & os.O_DIRECT
    assert (tmp_path / "direct").read_bytes() == _payload(2 * BLOCK_BYTES)


def test_direct_false_never_bypasses_the_page_cache(tmp_path: Path) -> None:
    flags = []

    def write(out):
        write_all(out, _payload(2 * BLOCK_BYTES))
        flags.append(fcntl.fcntl(out.fileno(), fcntl.F_GETFL))

    atomic_write(tmp_path / "buffered", write, direct=False)
    assert not flags[0] & os.O_DIRECT


def test_a_file_system_refusing_direct_writes_gets_them_through_the_page_cache(tmp_path, monkeypatch) -> None:
    """Some file systems accept O_DIRECT at fcntl and refuse the writes (EINVAL)."""
    real_write = os.write
    refused = []

    def write_refusing_direct(fd: int, data) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(durable.os, "write", write_refusing_direct)
    data = _payload(4 * BLOCK_BYTES + 3)
    atomic_write(tmp_path / "fallback", lambda out: write_all(out, data))
    assert (tmp_path / "fallback").read_bytes() == data
    assert len(refused) <= 1  # refused once at most, then no further direct write is tried


def test_a_failing_background_write_is_raised_and_nothing_is_replaced(tmp_path: Path) -> None:
    """A real write error (EFBIG past RLIMIT_FSIZE) in the writing thread reaches the caller."""
    target = tmp_path / "target"
    target.write_bytes(b"old content")
    script = textwrap.dedent(
        f"""
        import resource, sys
        from pathlib import Path
        from tiered_ckpt.io.durable import atomic_write, write_all
        resource.setrlimit(resource.RLIMIT_FSIZE, ({3 * BLOCK_BYTES}, {3 * BLOCK_BYTES}))
        try:
            atomic_write(Path({str(target)!r}), lambda out: write_all(out, bytes({8 * BLOCK_BYTES})))
        except OSError as error:
            print("raised", error.errno)
            sys.exit(0)
        print("no error")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == f"raised {errno.EFBIG}", result.stderr
    assert target.read_bytes() == b"old content"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]


def test_an_error_while_writing_removes_the_temp_file_and_stops_the_thread(tmp_path: Path) -> None:
    target = tmp_path / "target"
    write_bytes(target, b"old")

    def write(out):
        write_all(out, _payload(3 * BLOCK_BYTES))
        raise ValueError("caller failed half way")

    with pytest.raises(ValueError, match="half way"):
        atomic_write(target, write)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]
    assert not [t for t in threading.enumerate() if t.name == "tiered-ckpt-write"]


def test_create_only_refuses_an_existing_name(tmp_path: Path) -> None:
    write_bytes(tmp_path / "once", b"first", create_only=True)
    with pytest.raises(FileExistsError):
        write_bytes(tmp_path / "once", b"second", create_only=True)
    assert (tmp_path / "once").read_bytes() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["once"]
