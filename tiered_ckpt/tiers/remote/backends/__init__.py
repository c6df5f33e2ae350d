"""The stores behind the object-store tier, one module each, and the one place that picks one.

:func:`open_backend` maps the URL's protocol to the backend module that knows its store
(``s3``, ``gs``, ``az``, a file system); fsspec's own registry (``url_to_fs``) decides the
filesystem, and any protocol without a module of ours gets the generic
:class:`~tiered_ckpt.tiers.remote.backends.fsspec.FsspecBackend`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tiered_ckpt.errors import RemoteError
from tiered_ckpt.tiers.remote.backends.azure import AzureBackend
from tiered_ckpt.tiers.remote.backends.base import Backend
from tiered_ckpt.tiers.remote.backends.fsspec import FsspecBackend
from tiered_ckpt.tiers.remote.backends.gcs import GcsBackend
from tiered_ckpt.tiers.remote.backends.posix import PosixBackend
from tiered_ckpt.tiers.remote.backends.s3 import S3Backend
from tiered_ckpt.tiers.remote.retry import RetryPolicy, is_transient

__all__ = ["open_backend"]

_BY_PROTOCOL: dict[str, type[FsspecBackend]] = {
    "s3": S3Backend,
    "s3a": S3Backend,
    "gs": GcsBackend,
    "gcs": GcsBackend,
    "az": AzureBackend,
    "abfs": AzureBackend,
    "abfss": AzureBackend,
    "file": PosixBackend,
    "local": PosixBackend,
}


def open_backend(
    url: str, storage_options: Mapping[str, Any], *, retry: RetryPolicy, part_bytes: int, part_concurrency: int
) -> Backend:
    """The backend for ``url`` (a plain path is a file system), its client opened with
    ``storage_options`` under ``retry``'s timeouts, pooling (S3) twice ``part_concurrency``
    connections: the parts in flight, and as many checks and small requests beside them.
    Raises :class:`RemoteError` if fsspec cannot open it (a missing client package, a bad
    option); the options never appear in the message."""
    protocol = url.partition("://")[0] if "://" in url else "file"
    kind = _BY_PROTOCOL.get(protocol, FsspecBackend)
    try:
        fs, root = kind.open_filesystem(url, storage_options, retry, connections=2 * part_concurrency)
    except Exception as exc:  # a missing backend, a bad option, a backend that connects at once and fails
        raise RemoteError(f"cannot open {url}: {type(exc).__name__}: {exc}", transient=is_transient(exc)) from exc
    return kind(url, fs, root, retry=retry, part_bytes=part_bytes, part_concurrency=part_concurrency)
