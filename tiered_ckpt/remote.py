"""The remote tier: committed checkpoints under one fsspec URL (``s3://``, ``gs://``, ``memory://`` ...).

Layout under the URL::

    step-000000001200/rank-00000-of-00004.safetensors
    step-000000001200/...
    step-000000001200/manifest.json     the remote manifest, written last
    latest                              the newest committed step (a hint, written after it)

Uploading a step, as :class:`~tiered_ckpt.uploader.Uploader` drives it:

1. :meth:`RemoteTier.upload_shard` puts each shard with its sha256 as object metadata
   where the store keeps metadata (S3, GCS), and :meth:`RemoteTier.confirm_shard`
   checks the object's size and stored sha256: a shard is never taken as uploaded on
   the PUT's word alone;
2. :meth:`RemoteTier.commit` writes the remote manifest, create-only where the store
   supports it; :meth:`RemoteTier.set_latest` then moves ``latest``. A step is visible remotely exactly when its
   remote manifest exists.

Every backend error leaves this module as :class:`RemoteError`, its ``transient`` flag
set when trying again may help (throttling, 5xx, resets, timeouts), the original
exception chained. Storage options (credentials) are never put in messages or reprs.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fsspec.core import url_to_fs

from .errors import ChecksumMismatchError, ManifestError, RemoteError
from .layout import MANIFEST_NAME, parse_step_dir_name, step_dir_name
from .local import atomic_write
from .manifest import MAX_MANIFEST_BYTES, RemoteManifest, ShardManifest, ShardRecord
from .shardfile import ShardDigest, copy_and_hash, hash_stream

__all__ = ["RemoteTier", "is_transient"]

LATEST_NAME = "latest"
# s3fs's default 50 MiB parts leave a 256 MiB shard in 3-5 parts; 16 MiB parts let its
# concurrent part uploads (max_concurrency, 10 by default) keep the link busy.
DEFAULT_PART_BYTES = 16 << 20
SHA256_METADATA_KEY = "sha256"

_TRANSIENT_ERRNOS = {
    errno.EBUSY,  # s3fs: SlowDown, ServiceUnavailable
    errno.EAGAIN,
    errno.ETIMEDOUT,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ECONNREFUSED,
    errno.EPIPE,
    getattr(errno, "EREMOTEIO", errno.EIO),  # s3fs: InternalError (HTTP 500)
}
_TRANSIENT_NAMES = (
    "Timeout",
    "ConnectionError",
    "ConnectionClosed",
    "ServerDisconnected",
    "ClientPayloadError",
    "ClientOSError",
    "EndpointConnectionError",
    "IncompleteRead",
    "RetryError",
    "ServiceUnavailable",
    "TransportError",
)
_TRANSIENT_TEXT = (
    "SlowDown",
    "Service Unavailable",
    "503",
    "500 Internal",
    "Throttl",
    "Please reduce your request rate",
)


def is_transient(exc: BaseException) -> bool:
    """True if a request that failed with ``exc`` may succeed when tried again."""
    if isinstance(exc, (PermissionError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError)):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    names = [cls.__name__ for cls in type(exc).__mro__]
    if any(marker in name for name in names for marker in _TRANSIENT_NAMES):
        return True
    text = str(exc)
    return any(marker in text for marker in _TRANSIENT_TEXT)


class RemoteTier:
    """Checkpoints under ``url``, reached through fsspec with ``storage_options``."""

    def __init__(
        self, url: str, storage_options: Mapping[str, Any] | None = None, *, part_bytes: int = DEFAULT_PART_BYTES
    ) -> None:
        self.url = url.rstrip("/")
        self._part_bytes = part_bytes
        try:
            self._fs, self._root = url_to_fs(self.url, **dict(storage_options or {}))
        except (ImportError, ValueError, TypeError) as exc:  # a missing backend, a bad option
            raise RemoteError(f"cannot open {self.url}: {exc}", transient=False) from exc
        self._root = self._root.rstrip("/")
        protocol = self._fs.protocol
        self._protocols = {protocol} if isinstance(protocol, str) else set(protocol)

    def __repr__(self) -> str:
        return f"RemoteTier({self.url!r})"

    # -- names --------------------------------------------------------------------------

    def _path(self, step: int, name: str | None = None) -> str:
        prefix = f"{self._root}/{step_dir_name(step)}"
        return f"{prefix}/{name}" if name else prefix

    def location(self, step: int, name: str | None = None) -> str:
        """The URL of a step's prefix or of one object in it, for messages."""
        prefix = f"{self.url}/{step_dir_name(step)}"
        return f"{prefix}/{name}" if name else prefix

    @contextmanager
    def _translated(self, what: str) -> Iterator[None]:
        try:
            yield
        except (RemoteError, ChecksumMismatchError, ManifestError):
            raise
        except Exception as exc:
            transient = is_transient(exc)
            kind = "transient" if transient else "permanent"
            raise RemoteError(f"{what}: {kind} error {type(exc).__name__}: {exc}", transient=transient) from exc

    def _fresh_info(self, path: str) -> dict[str, Any]:
        self._fs.invalidate_cache(path)
        return self._fs.info(path)

    def _exists(self, path: str) -> bool:
        self._fs.invalidate_cache(path)
        return self._fs.exists(path)

    # -- listing ------------------------------------------------------------------------

    def _step_prefixes(self) -> list[int]:
        self._fs.invalidate_cache(self._root)
        try:
            entries = self._fs.ls(self._root, detail=False)
        except FileNotFoundError:
            return []
        steps = (parse_step_dir_name(entry.rstrip("/").rsplit("/", 1)[-1]) for entry in entries)
        return sorted(step for step in steps if step is not None)

    def committed_steps(self) -> list[int]:
        """Steps whose remote manifest exists, oldest first."""
        with self._translated(f"listing {self.url}"):
            return [step for step in self._step_prefixes() if self._exists(self._path(step, MANIFEST_NAME))]

    def uncommitted_steps(self) -> list[int]:
        """Step prefixes holding objects but no remote manifest (half-uploaded steps)."""
        with self._translated(f"listing {self.url}"):
            return [step for step in self._step_prefixes() if not self._exists(self._path(step, MANIFEST_NAME))]

    def read_manifest(self, step: int) -> RemoteManifest:
        """Read and strictly validate the remote manifest of ``step``."""
        location = self.location(step, MANIFEST_NAME)
        with self._translated(f"reading {location}"):
            info = self._fresh_info(self._path(step, MANIFEST_NAME))
            if info.get("size", 0) > MAX_MANIFEST_BYTES:
                raise ManifestError(f"{location}: {info['size']} bytes, over the {MAX_MANIFEST_BYTES} limit")
            data = self._fs.cat_file(self._path(step, MANIFEST_NAME))
        remote = RemoteManifest.from_json(data, source=location)
        if remote.manifest.step != step:
            raise ManifestError(f"{location}: field 'step' is {remote.manifest.step}, the prefix is step {step}")
        return remote

    # -- uploading ----------------------------------------------------------------------

    def _put_kwargs(self, sha256: str) -> dict[str, Any]:
        """Backend arguments of a shard's PUT: its sha256 as metadata, and the multipart part size."""
        if self._protocols & {"s3", "s3a"}:
            return {"Metadata": {SHA256_METADATA_KEY: sha256}, "chunksize": self._part_bytes}
        if self._protocols & {"gs", "gcs"}:
            return {"metadata": {SHA256_METADATA_KEY: sha256}, "chunksize": self._part_bytes}
        return {}

    def _stored_sha256(self, path: str, info: Mapping[str, Any]) -> str | None:
        """The sha256 the store keeps for an object, or None where it keeps none."""
        if self._protocols & {"s3", "s3a"}:
            return self._fs.metadata(path).get(SHA256_METADATA_KEY)
        if self._protocols & {"gs", "gcs"}:
            return (info.get("metadata") or {}).get(SHA256_METADATA_KEY)
        return None

    def _confirmed(self, step: int, record: ShardRecord) -> tuple[bool, str]:
        path = self._path(step, record.path)
        try:
            info = self._fresh_info(path)
        except FileNotFoundError:
            return False, "missing"
        if info.get("size") != record.size_bytes:
            return False, f"size {info.get('size')}, expected {record.size_bytes}"
        stored = self._stored_sha256(path, info)
        if stored is not None and stored != record.sha256:
            return False, f"stored sha256 {stored}, expected {record.sha256}"
        return True, "ok"

    def shard_is_uploaded(self, step: int, record: ShardRecord) -> bool:
        """True if the shard's object exists with the recorded size (and sha256, where kept)."""
        with self._translated(f"checking {self.location(step, record.path)}"):
            return self._confirmed(step, record)[0]

    def upload_shard(self, step: int, local_path: Path, record: ShardRecord) -> None:
        """Put one shard (with its sha256 as metadata where kept); :meth:`confirm_shard` checks it."""
        location = self.location(step, record.path)
        with self._translated(f"uploading {local_path} to {location}"):
            self._fs.put_file(str(local_path), self._path(step, record.path), **self._put_kwargs(record.sha256))

    def confirm_shard(self, step: int, record: ShardRecord) -> None:
        """Raise :class:`RemoteError` (transient: upload it again) unless the object matches the record."""
        location = self.location(step, record.path)
        with self._translated(f"confirming {location}"):
            confirmed, problem = self._confirmed(step, record)
        if not confirmed:
            raise RemoteError(f"{location}: not confirmed after the upload: {problem}", transient=True)

    def commit(self, manifest: ShardManifest) -> RemoteManifest:
        """Write the remote manifest of ``manifest``'s step, create-only where the store supports it.

        Call only once every shard is confirmed. If the step is already committed with
        the same shards (a retried or resumed commit), that commit is returned.
        """
        step = manifest.step
        remote = RemoteManifest(manifest, committed_at=time.time())
        location = self.location(step, MANIFEST_NAME)
        with self._translated(f"committing {location}"):
            try:
                self._fs.pipe_file(self._path(step, MANIFEST_NAME), remote.to_json().encode(), mode="create")
            except FileExistsError:
                existing = self.read_manifest(step)
                if existing.manifest.shards != manifest.shards:
                    raise RemoteError(
                        f"{location}: a different checkpoint of step {step} is already committed", transient=False
                    ) from None
                remote = existing
        return remote

    def set_latest(self, step: int) -> None:
        """Point ``latest`` at ``step`` (a hint for people and tools; listing is the truth)."""
        with self._translated(f"writing {self.url}/{LATEST_NAME}"):
            self._fs.pipe_file(f"{self._root}/{LATEST_NAME}", f"{step}\n".encode())

    # -- downloading --------------------------------------------------------------------

    def download_shard(self, step: int, record: ShardRecord, target: Path) -> None:
        """Stream a shard into ``target`` atomically, hashing as it streams.

        ``target`` appears only if the bytes match the record's size and sha256;
        otherwise :class:`ChecksumMismatchError` names the object.
        """
        location = self.location(step, record.path)

        def check(digest: ShardDigest) -> None:
            if digest.size_bytes != record.size_bytes or digest.sha256 != record.sha256:
                raise ChecksumMismatchError(
                    f"rank {record.rank} shard {location}: {digest.size_bytes} bytes with sha256 {digest.sha256}, "
                    f"the manifest records {record.size_bytes} bytes with sha256 {record.sha256}"
                )

        with self._translated(f"downloading {location}"):
            with self._fs.open(self._path(step, record.path), "rb", block_size=16 << 20) as source:
                atomic_write(target, lambda out: copy_and_hash(source, out), check=check)

    def check_shard(self, step: int, record: ShardRecord) -> str | None:
        """Stream and hash one shard object; return the problem, or None if it matches the record."""
        location = self.location(step, record.path)
        with self._translated(f"reading {location}"):
            try:
                with self._fs.open(self._path(step, record.path), "rb", block_size=16 << 20) as source:
                    digest = hash_stream(source, "full")
            except FileNotFoundError:
                return f"{location}: missing"
        if digest.size_bytes != record.size_bytes or digest.sha256 != record.sha256:
            return f"{location}: {digest.size_bytes} bytes with sha256 {digest.sha256}, expected {record.sha256}"
        return None

    # -- deleting -----------------------------------------------------------------------

    def delete_step(self, step: int) -> None:
        """Delete a step: its remote manifest first (the step turns invisible), then its objects."""
        with self._translated(f"deleting {self.location(step)}"):
            manifest = self._path(step, MANIFEST_NAME)
            if self._exists(manifest):
                self._fs.rm_file(manifest)
            prefix = self._path(step)
            self._fs.invalidate_cache(prefix)
            if self._fs.exists(prefix):
                self._fs.rm(prefix, recursive=True)
