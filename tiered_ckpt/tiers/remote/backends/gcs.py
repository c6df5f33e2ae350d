"""The GCS backend, through gcsfs: the sha256 as object metadata, GCS's own MD5 and CRC32C.

GCS computes an object's ``md5Hash`` and ``crc32c`` itself from the bytes it received;
both are compared after a PUT, and the CRC32C is what the remote manifest records. gcsfs
retries each request up to 6 times on its own and has no switch to turn that off.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from tiered_ckpt.format.manifest import ShardRecord
from tiered_ckpt.tiers.remote.backends.base import SHA256_METADATA_KEY, Head, Sent
from tiered_ckpt.tiers.remote.backends.fsspec import FsspecBackend, seconds_left
from tiered_ckpt.tiers.remote.backends.s3 import same_checksum
from tiered_ckpt.tiers.remote.checksums import StoreSums, hash_for_store
from tiered_ckpt.tiers.remote.retry import RetryPolicy

__all__ = ["GcsBackend"]


class GcsBackend(FsspecBackend):
    """A bucket (and prefix) on Google Cloud Storage."""

    # create-only: gcsfs's pipe_file(mode="create") uploads with ifGenerationMatch=0, refused (412) if the object exists
    capabilities = replace(FsspecBackend.capabilities, create_only_commit=True, store_checksums=True)
    keeps_metadata = True
    BUCKET_SCHEME = "gs"
    READ_AHEAD = True

    @classmethod
    def client_options(
        cls, options: Mapping[str, Any], retry: RetryPolicy, *, connections: int | None = None
    ) -> dict[str, Any]:
        merged = super().client_options(options, retry, connections=connections)
        merged.setdefault("requests_timeout", retry.timeout_seconds)
        return merged

    def sums(self, local_path: Path, record: ShardRecord) -> StoreSums | None:
        hashes = hash_for_store(local_path, record, chunk_bytes=self.part_bytes, md5=True, split=False)
        assert hashes.md5 is not None
        return StoreSums(base64.b64encode(hashes.md5).decode(), crc32c=hashes.crc32c[0])

    def put_shard(self, local_path: Path, path: str, record: ShardRecord, *, deadline: float | None) -> Sent:
        sums = self.sums(local_path, record)  # checks the file before an object is made of it
        self.fs.put_file(
            str(local_path),
            path,
            metadata={SHA256_METADATA_KEY: record.sha256},
            chunksize=self.part_bytes,
            **self._limit(seconds_left(deadline)),
        )
        return Sent(sums)

    def head(self, path: str, *, timeout: float | None = None) -> Head:
        info = self._info(path, timeout)
        return Head(int(info.get("size") or 0), (info.get("metadata") or {}).get(SHA256_METADATA_KEY), info)

    def kept_checksum(self, head: Head, algorithm: str) -> str | None:
        kept = head.answer.get("crc32c")  # GCS keeps it in the object's metadata
        return f"crc32c:{kept}" if algorithm == "crc32c" and kept else None

    def store_problem(self, head: Head, sums: StoreSums) -> str | None:
        kept = head.answer.get("md5Hash")
        if sums.etag is not None and not same_checksum(kept, sums.etag):
            return f"the store computed md5Hash {kept} of the bytes it holds, expected {sums.etag}"
        return None

    def check_bucket(self) -> None:
        self._check_bucket_by(
            lambda bucket, prefix: self.fs.call("GET", "b/{}/o", bucket, prefix=prefix or None, maxResults=1), "gs"
        )
