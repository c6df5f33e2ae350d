"""Behaviour around any backend, as wrappers rather than switches inside a backend or the tier.

A :class:`Wrapper` passes every call through to the backend it wraps; a subclass changes
the calls it overrides (a test's fault injection is one). :class:`Counting`, the outermost
wrapper of every object-store tier, counts the requests its shard uploads made and how
many of them the store throttled (read by tests and the benchmark)."""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, BinaryIO

from tiered_ckpt.format.manifest import ShardRecord
from tiered_ckpt.tiers.base import Capabilities
from tiered_ckpt.tiers.remote.backends.base import Backend, Head, OpenUpload, Sent
from tiered_ckpt.tiers.remote.checksums import StoreSums

__all__ = ["Counting", "Wrapper"]


class Wrapper:
    """A backend that is ``inner``: subclasses change the calls they override."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def root(self) -> str:
        return self.inner.root

    @property
    def fs(self) -> Any:
        return self.inner.fs

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    @property
    def keeps_metadata(self) -> bool:
        return self.inner.keeps_metadata

    @property
    def bucket(self) -> str | None:
        return self.inner.bucket

    def sums(self, local_path: Path, record: ShardRecord) -> StoreSums | None:
        return self.inner.sums(local_path, record)

    def put_shard(self, local_path: Path, path: str, record: ShardRecord, *, deadline: float | None) -> Sent:
        return self.inner.put_shard(local_path, path, record, deadline=deadline)

    def put_bytes(self, path: str, data: bytes, *, create_only: bool = False, timeout: float | None = None) -> None:
        self.inner.put_bytes(path, data, create_only=create_only, timeout=timeout)

    def head(self, path: str, *, timeout: float | None = None) -> Head:
        return self.inner.head(path, timeout=timeout)

    def kept_checksum(self, head: Head, algorithm: str) -> str | None:
        return self.inner.kept_checksum(head, algorithm)

    def store_problem(self, head: Head, sums: StoreSums) -> str | None:
        return self.inner.store_problem(head, sums)

    def size(self, path: str, *, timeout: float | None = None) -> int:
        return self.inner.size(path, timeout=timeout)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def open(self, path: str) -> AbstractContextManager[BinaryIO]:
        return self.inner.open(path)

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        return self.inner.read(path, start, end)

    def list_names(self, prefix: str) -> list[str]:
        return self.inner.list_names(prefix)

    def find(self, prefix: str) -> list[str]:
        return self.inner.find(prefix)

    def delete(self, paths: list[str]) -> None:
        self.inner.delete(paths)

    def delete_prefix(self, prefix: str) -> None:
        self.inner.delete_prefix(prefix)

    def open_uploads(self) -> list[OpenUpload]:
        return self.inner.open_uploads()

    def abort_upload(self, upload: OpenUpload) -> None:
        self.inner.abort_upload(upload)

    def check_bucket(self) -> None:
        self.inner.check_bucket()


class Counting(Wrapper):
    """``inner``, counting what its shard uploads took: ``requests`` made and ``throttled`` by the
    store (shards go up from several threads at once: the counts are kept under a lock)."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.requests = 0
        self.throttled = 0
        self._lock = threading.Lock()

    def put_shard(self, local_path: Path, path: str, record: ShardRecord, *, deadline: float | None) -> Sent:
        sent = self.inner.put_shard(local_path, path, record, deadline=deadline)
        with self._lock:
            self.requests += sent.requests
            self.throttled += sent.throttled
        return sent
