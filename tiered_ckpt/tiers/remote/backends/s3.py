"""The S3 backend: shards through the multipart client (:mod:`.multipart`), the store's CRC32C.

S3 checks every part against the CRC32C it was sent with and keeps the object's
(composite for a multipart object: ``base64(crc32c(part digests))-N``); a one-request
object also has its MD5 as ETag. Both are compared after a PUT, so bytes changed in
transit are never confirmed, and the CRC32C is what the remote manifest records. Deletes
go by ``DeleteObjects`` naming each key; a bucket is checked by ``ListObjectsV2`` of one key.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from fsspec.asyn import sync

from tiered_ckpt.format.manifest import ShardRecord
from tiered_ckpt.tiers.remote.backends.base import SHA256_METADATA_KEY, Head, OpenUpload, Sent
from tiered_ckpt.tiers.remote.backends.fsspec import FsspecBackend, seconds_left
from tiered_ckpt.tiers.remote.backends.multipart import Upload, Window, list_open_uploads
from tiered_ckpt.tiers.remote.checksums import StoreSums, check_source, hash_for_store
from tiered_ckpt.tiers.remote.retry import RetryPolicy

__all__ = ["DELETE_BATCH", "S3Backend", "same_checksum"]

DELETE_BATCH = 1000  # keys per S3 DeleteObjects request (its limit)


def same_checksum(kept: str | None, expected: str) -> bool:
    """True if the store's checksum ``kept`` is ``expected``; a composite's part count (``-N``)
    may be left off by the store (some S3-compatible stores leave it off a HEAD's answer)."""
    base, dash, parts = expected.rpartition("-")
    return kept is not None and (kept == expected or (bool(dash) and parts.isdigit() and kept == base))


class S3Backend(FsspecBackend):
    """A bucket (and prefix) on S3 or a store speaking its API, through s3fs.

    ``window`` holds how many parts may be in flight at once across this backend's uploads
    (see :class:`~tiered_ckpt.tiers.remote.backends.multipart.Window`)."""

    # create-only: s3fs's pipe_file(mode="create") is a PutObject with If-None-Match: *, refused (412) if the key exists
    capabilities = replace(FsspecBackend.capabilities, create_only_commit=True, store_checksums=True)
    keeps_metadata = True
    BUCKET_SCHEME = "s3"
    READ_AHEAD = True

    def __init__(self, url: str, fs: Any, root: str, *, retry: RetryPolicy, part_bytes: int, part_concurrency: int):
        super().__init__(url, fs, root, retry=retry, part_bytes=part_bytes, part_concurrency=part_concurrency)
        self.window = Window(part_concurrency)
        self._retry = retry
        fs.retries = 1  # s3fs's own retry loop (no constructor argument): ours are the only retries

    @classmethod
    def client_options(
        cls, options: Mapping[str, Any], retry: RetryPolicy, *, connections: int | None = None
    ) -> dict[str, Any]:
        merged = super().client_options(options, retry, connections=connections)
        config = dict(merged.get("config_kwargs") or {})
        if connections is not None:
            config.setdefault("max_pool_connections", connections)
        config.setdefault("connect_timeout", retry.timeout_seconds)
        config.setdefault("read_timeout", retry.timeout_seconds)
        config["retries"] = {"total_max_attempts": 1}  # ours are the only retries
        merged["config_kwargs"] = config
        return merged

    def sums(self, local_path: Path, record: ShardRecord) -> StoreSums | None:
        multipart = record.size_bytes >= 2 * self.part_bytes  # as the upload cuts it
        # S3's ETag of a multipart object is not compared: its CRC32C is.
        hashes = hash_for_store(local_path, record, chunk_bytes=self.part_bytes, md5=not multipart, split=multipart)
        return StoreSums(None if hashes.md5 is None else f'"{hashes.md5.hex()}"', hashes.crc32c)

    def put_shard(self, local_path: Path, path: str, record: ShardRecord, *, deadline: float | None) -> Sent:
        bucket, key, _version = self.fs.split_path(path)
        upload = Upload(
            self.fs,
            local_path,
            bucket,
            key,
            part_bytes=self.part_bytes,
            window=self.window,
            max_tries=self._retry.max_tries,
            backoff_seconds=self._retry.backoff_seconds,
            extra={"Metadata": {SHA256_METADATA_KEY: record.sha256}},
            deadline=deadline,
            verify_source=functools.partial(check_source, local_path, record),
        )
        stats = sync(self.fs.loop, upload.run, **self._limit(seconds_left(deadline)))
        return Sent(stats.sums, stats.requests, stats.throttled)

    def head(self, path: str, *, timeout: float | None = None) -> Head:
        bucket, key, _version = self.fs.split_path(path)
        answer = self.fs.call_s3("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED", **self._limit(timeout))
        return Head(int(answer.get("ContentLength", -1)), answer.get("Metadata", {}).get(SHA256_METADATA_KEY), answer)

    def kept_checksum(self, head: Head, algorithm: str) -> str | None:
        kept = head.answer.get("ChecksumCRC32C" if algorithm == "crc32c" else "ChecksumSHA256")
        return f"{algorithm}:{kept}" if kept else None

    def store_problem(self, head: Head, sums: StoreSums) -> str | None:
        computed = {"ETag": sums.etag, "ChecksumCRC32C": sums.kept and sums.kept.removeprefix("crc32c:")}
        for name, expected in computed.items():
            if expected is not None and not same_checksum(head.answer.get(name), expected):
                return f"the store computed {name} {head.answer.get(name)} of the bytes it holds, expected {expected}"
        return None

    def delete(self, paths: list[str]) -> None:
        """``DeleteObjects`` naming each key, 1000 a request."""
        bucket = self.fs.split_path(self.root)[0]
        keys = [self.fs.split_path(path)[1] for path in paths]
        for start in range(0, len(keys), DELETE_BATCH):
            batch = [{"Key": key} for key in keys[start : start + DELETE_BATCH]]
            answer = self.fs.call_s3("delete_objects", Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
            failed = answer.get("Errors") or []
            if failed:
                first = failed[0]
                raise OSError(f"deleting s3://{bucket}/{first.get('Key')}: {first.get('Code')} {first.get('Message')}")

    def open_uploads(self) -> list[OpenUpload]:
        bucket, prefix, _version = self.fs.split_path(self.root)
        return [
            OpenUpload(f"{bucket}/{upload['Key']}", upload.get("Initiated"), upload["UploadId"])
            for upload in list_open_uploads(self.fs, bucket, prefix)
        ]

    def abort_upload(self, upload: OpenUpload) -> None:
        bucket, key, _version = self.fs.split_path(upload.path)
        self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload.upload_id)

    def check_bucket(self) -> None:
        self._check_bucket_by(
            lambda bucket, prefix: self.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=1), "s3"
        )
