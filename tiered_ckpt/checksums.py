"""The checksums an object store computes of an uploaded shard, computed locally before its upload.

One pass over the local file gives what the remote tier compares after a PUT (the store's
own checksum of the bytes it received: S3's ETag, GCS's md5Hash) and what it records in
the remote manifest for checks without a download (S3's SHA256 per part and of the whole
object; GCS's CRC32C). The same pass checks the file against its record's xxh3-64, so a
shard damaged on local disk is never uploaded.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from .manifest import ShardRecord
from .shardfile import ShardDigest

__all__ = ["StoreSums", "store_sums", "composite_sha256"]


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def composite_sha256(parts: Sequence[str]) -> str:
    """The ``ChecksumSHA256`` S3 keeps for an object sent as ``parts`` (their SHA256, base64):
    the one part's, or the SHA256 of the parts' digests with ``-N``."""
    if len(parts) == 1:
        return parts[0]
    digests = b"".join(base64.b64decode(part) for part in parts)
    return f"{_b64(hashlib.sha256(digests).digest())}-{len(parts)}"


def _crc32c() -> Any:
    """A CRC32C hasher (google-crc32c, which gcsfs brings; part of the ``gcs`` extra)."""
    import google_crc32c

    return google_crc32c.Checksum()


@dataclass(frozen=True)
class StoreSums:
    """A shard's checksums as the store will compute them: ``store`` (S3's ETag, GCS's
    md5Hash; None where the store computes none we read), ``parts`` (S3: each part's SHA256,
    base64, parts cut every ``part_bytes`` as the upload cuts them) and ``crc32c`` (GCS)."""

    store: str | None
    parts: tuple[str, ...] = ()
    crc32c: str | None = None

    @property
    def kept(self) -> str | None:
        """The checksum the store keeps for the object, as the remote manifest records it."""
        if self.parts:
            return "sha256:" + composite_sha256(self.parts)
        return "crc32c:" + self.crc32c if self.crc32c is not None else None


def store_sums(path: Path, record: ShardRecord, *, s3: bool, gcs: bool, part_bytes: int) -> StoreSums:
    """The checksums S3 (``s3``) or GCS (``gcs``) will compute of ``path`` once uploaded; see the module doc.

    Raises :class:`ChecksumMismatchError` if the file does not match ``record``'s size and
    xxh3-64 (xxh3 rather than sha256: this pass costs the upload CPU, and the store's own
    checksums then guard the bytes on their way).
    """
    if not (s3 or gcs):
        return StoreSums(None)
    multipart = s3 and record.size_bytes >= 2 * part_bytes
    md5s, shas, whole, size = [hashlib.md5()], [hashlib.sha256()], xxhash.xxh3_64(), 0
    crc = _crc32c() if gcs else None
    with open(path, "rb", buffering=0) as source:
        while chunk := source.read(part_bytes):
            whole.update(chunk)
            if crc is not None:
                crc.update(chunk)
            if multipart and size:
                md5s.append(hashlib.md5())
                shas.append(hashlib.sha256())
            md5s[-1].update(chunk)
            shas[-1].update(chunk)
            size += len(chunk)
    record.verify(ShardDigest(size, "", whole.hexdigest()), f"{path} (before its upload)")
    if crc is not None:
        return StoreSums(_b64(md5s[0].digest()), crc32c=_b64(crc.digest()))
    parts = tuple(_b64(sha.digest()) for sha in shas)
    if not multipart:  # one request, its ETag the MD5 of the body
        return StoreSums(f'"{md5s[0].hexdigest()}"', parts)
    return StoreSums(f'"{hashlib.md5(b"".join(d.digest() for d in md5s)).hexdigest()}-{len(md5s)}"', parts)
