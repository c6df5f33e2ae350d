"""The generic backend: any filesystem fsspec's registry knows (``memory://``, ``hdfs://`` ...).

The other backends build on :class:`FsspecBackend` and change what their store does
differently. Every list and delete names exact paths: fsspec's ``rm(recursive=True)``,
``glob`` and ``expand_path`` treat ``[]``, ``*`` and ``?`` as patterns and are never called,
so a URL such as ``s3://b/sweep[12]`` is as good as any.

A small object written create-only goes through fsspec's ``pipe_file(mode="create")``: a
conditional request where the filesystem sends one (s3fs: ``If-None-Match: *``; gcsfs:
``ifGenerationMatch=0``), but in fsspec's own implementation, which every other filesystem
inherits, a check for the object and then a write, which two writers can both pass. So this
backend claims no create-only commits (``capabilities.create_only_commit`` is False); those
whose store refuses a second create atomically (S3, GCS, Azure, POSIX) claim them. Here a
second commit of a committed step is still refused (the check sees the first); two commits
racing between check and write take two live runs committing one step under one prefix,
which the run leases report (:mod:`~tiered_ckpt.tiers.remote.leases`; ``other_owners="refuse"``
keeps the second run from starting).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO, cast

from fsspec.core import url_to_fs
from fsspec.implementations.memory import MemoryFileSystem

from tiered_ckpt.errors import RemoteError
from tiered_ckpt.format.manifest import ShardRecord
from tiered_ckpt.io.hashing import hash_stream
from tiered_ckpt.tiers.base import Capabilities
from tiered_ckpt.tiers.remote.backends.base import Head, OpenUpload, Sent
from tiered_ckpt.tiers.remote.checksums import StoreSums
from tiered_ckpt.tiers.remote.readahead import ReadAhead
from tiered_ckpt.tiers.remote.retry import RetryPolicy

__all__ = ["FsspecBackend", "READ_PART_BYTES", "STREAM_BLOCK_BYTES", "seconds_left"]

STREAM_BLOCK_BYTES = 16 << 20
READ_PART_BYTES = 8 << 20  # a stream's ranges read ahead (tiers/remote/readahead.py), part_concurrency at once


class FsspecBackend:
    """A store reached through the fsspec filesystem ``fs``, its objects under ``root``.

    A subclass states what its store does in the class attributes: ``capabilities``,
    ``keeps_metadata``, ``BUCKET_SCHEME`` (the scheme of :attr:`bucket`; None: no bucket) and
    ``READ_AHEAD`` (a network store serving each connection at a bounded rate: an object of at
    least two ``READ_PART_BYTES`` is read over ``part_concurrency`` connections, see
    :mod:`~tiered_ckpt.tiers.remote.readahead`)."""

    capabilities = Capabilities(
        durable=True, shared=True, create_only_commit=False, store_checksums=False, ranged_reads=True
    )
    keeps_metadata = False
    BUCKET_SCHEME: str | None = None
    READ_AHEAD = False

    def __init__(self, url: str, fs: Any, root: str, *, retry: RetryPolicy, part_bytes: int, part_concurrency: int):
        self.url, self.fs, self.root = url, fs, root.rstrip("/")
        self.part_bytes, self.part_concurrency = part_bytes, part_concurrency
        scheme = self.BUCKET_SCHEME
        self.bucket = None if scheme is None else f"{scheme}://{self.root.partition('/')[0]}"

    @classmethod
    def client_options(
        cls, options: Mapping[str, Any], retry: RetryPolicy, *, connections: int | None = None
    ) -> dict[str, Any]:
        """The fsspec options to open the filesystem with: the client's own retries off where it
        has a switch (ours are the only ones), request timeouts set, and where the client pools
        its connections, ``connections`` of them (None: the client's default) unless the options say."""
        merged = dict(options)
        merged.setdefault("skip_instance_cache", True)  # an instance of our own: its settings are ours to change
        return merged

    @classmethod
    def open_filesystem(
        cls, url: str, options: Mapping[str, Any], retry: RetryPolicy, *, connections: int | None = None
    ) -> tuple[Any, str]:
        """The fsspec filesystem fsspec's registry opens for ``url`` with :meth:`client_options`,
        and the URL's path as that filesystem names it."""
        fs, root = url_to_fs(url, **cls.client_options(options, retry, connections=connections))
        return fs, root

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def _limit(self, timeout: float | None) -> dict[str, Any]:
        """The keyword that cuts a call short (async filesystems take ``timeout``: fsspec cancels
        the request's coroutine), or none."""
        return {"timeout": timeout} if timeout is not None and getattr(self.fs, "async_impl", False) else {}

    def sums(self, local_path: Path, record: ShardRecord) -> StoreSums | None:
        return None

    def put_shard(self, local_path: Path, path: str, record: ShardRecord, *, deadline: float | None) -> Sent:
        # fsspec's generic files make the object when they close, with no way to abandon a write
        # that turned out wrong; so the file is checked first (by size and xxh3-64, as every
        # backend checks it: a compressed object's record keeps the sha256 of the shard inside).
        # It is this node's own committed file or temp copy, which nothing rewrites in between.
        with open(local_path, "rb") as source:
            digest = hash_stream(source, "fast")
        record.verify(replace(digest, sha256=""), f"{self.url}/{path[len(self.root) :].lstrip('/')} from {local_path}")
        self.fs.put_file(str(local_path), path, **self._limit(seconds_left(deadline)))
        return Sent(None)

    def put_bytes(self, path: str, data: bytes, *, create_only: bool = False, timeout: float | None = None) -> None:
        self.fs.pipe_file(path, data, mode="create" if create_only else "overwrite", **self._limit(timeout))

    def _info(self, path: str, timeout: float | None) -> dict[str, Any]:
        self.fs.invalidate_cache(path)
        info: dict[str, Any] = self.fs.info(path, **self._limit(timeout))
        return info

    def head(self, path: str, *, timeout: float | None = None) -> Head:
        info = self._info(path, timeout)
        return Head(int(info.get("size") or 0), None, info)

    def kept_checksum(self, head: Head, algorithm: str) -> str | None:
        return None

    def store_problem(self, head: Head, sums: StoreSums) -> str | None:
        return None

    def size(self, path: str, *, timeout: float | None = None) -> int:
        return int(self._info(path, timeout).get("size") or 0)

    def exists(self, path: str) -> bool:
        self.fs.invalidate_cache(path)
        return bool(self.fs.exists(path))

    def open(self, path: str) -> AbstractContextManager[BinaryIO]:
        source = self.fs.open(path, "rb", block_size=STREAM_BLOCK_BYTES)  # its size from one HEAD, no GET yet
        size = getattr(source, "size", None)
        if not self.READ_AHEAD or not isinstance(size, int) or size < 2 * READ_PART_BYTES:
            return source  # type: ignore[no-any-return]
        # Each range through the open file's own fetch: the requests its buffered reads would
        # make, pinned to the object it opened (S3: If-Match its ETag; a replaced object fails
        # the read as FileExpired, which is retried from the start).
        ahead = ReadAhead(source._fetch_range, size, READ_PART_BYTES, self.part_concurrency, closing=source)
        return cast(AbstractContextManager[BinaryIO], ahead)

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        return bytes(self.fs.cat_file(path, start=start, end=end))

    def list_names(self, prefix: str) -> list[str]:
        self.fs.invalidate_cache(prefix)
        try:
            entries = self.fs.ls(prefix, detail=False)
        except FileNotFoundError:
            return []
        return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries]

    def find(self, prefix: str) -> list[str]:
        self.fs.invalidate_cache(prefix)
        try:
            found = self.fs.find(prefix)
        except FileNotFoundError:
            return []
        return sorted(path for path in found if path.startswith(f"{prefix}/"))

    def delete(self, paths: list[str]) -> None:
        for path in paths:
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass

    def delete_prefix(self, prefix: str) -> None:
        self.delete(self.find(prefix))
        if isinstance(self.fs, MemoryFileSystem):  # it keeps directories of its own, which find does not list
            for directory in sorted(d for d in self.fs.pseudo_dirs if d == prefix or d.startswith(f"{prefix}/")):
                self.fs.pseudo_dirs.remove(directory)
        self.fs.invalidate_cache(prefix)

    def open_uploads(self) -> list[OpenUpload]:
        return []

    def abort_upload(self, upload: OpenUpload) -> None:
        raise NotImplementedError(f"{self.url} has no multipart uploads")

    def check_bucket(self) -> None:
        return None

    def _check_bucket_by(self, list_one: Callable[[str, str], object], scheme: str) -> None:
        """Make one listing request (``list_one(bucket, prefix)``) and raise a permanent
        :class:`RemoteError` naming the bucket if it does not exist or cannot be listed."""
        bucket, prefix = self.root.partition("/")[::2]
        try:
            list_one(bucket, f"{prefix}/" if prefix else "")
        except FileNotFoundError as exc:
            raise RemoteError(
                f"{self.url}: the bucket {bucket!r} does not exist ({scheme}://{bucket}): {exc}", transient=False
            ) from exc
        except PermissionError as exc:
            raise RemoteError(
                f"{self.url}: access to the bucket {bucket!r} is denied (it cannot be listed with these "
                f"credentials): {exc}",
                transient=False,
            ) from exc


def seconds_left(deadline: float | None) -> float | None:
    """The seconds left before ``deadline`` (the tier starts no request after it)."""
    return None if deadline is None else max(deadline - time.monotonic(), 1e-3)
