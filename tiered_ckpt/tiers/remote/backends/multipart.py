"""S3 uploads for the remote tier: parts in a sliding window sized by AIMD, the store's own
CRC32C checksum on every request, and no multipart upload left open when one fails.

Why by hand: s3fs's ``put_file`` (the library under the remote tier) sends the parts of a
large file in batches (no part of the next batch starts before the slowest of the last
one ends), reads the file on its event loop, sends no checksum with a part, fails the
whole file when one part is throttled, and leaves its multipart upload open when it is
cancelled (a deadline). This module makes the same S3 requests through the client of the
same s3fs instance (its credentials, endpoint and session), without those five limits:

1. a file below ``2 * part_bytes`` is checked (``verify_source``), then goes up in one
   ``PutObject`` with its ``ChecksumCRC32C``;
2. a larger one: ``CreateMultipartUpload`` (``ChecksumAlgorithm="CRC32C"``), then its parts
   (cut every ``part_bytes``, as s3fs cuts them), each read and hashed in a worker thread
   and sent with its ``ChecksumCRC32C`` while at most :attr:`Window.size` parts are in
   flight; ``verify_source`` runs beside them, in a worker thread of its own;
3. a part the store throttles (503 SlowDown, 429) is sent again after a backoff and halves
   the window (multiplicative decrease); each part sent grows it by ``1 / size``
   (additive increase: one more part per window's worth of parts), up to ``limit``;
4. once every part is sent and ``verify_source`` passed, ``CompleteMultipartUpload`` with
   every part's checksum; on any failure, cancellation included, ``AbortMultipartUpload``.

The checksums the store will hold (:class:`~tiered_ckpt.tiers.remote.checksums.StoreSums`: the one
request's MD5 ETag, the parts' CRC32C) come out in :attr:`UploadStats.sums`, computed from
the bytes as they were sent: hashing rides along with the sending instead of a pass
over the file before it.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import os
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiered_ckpt.errors import RemoteError
from tiered_ckpt.io.hashing import part_crc32c
from tiered_ckpt.tiers.remote.checksums import StoreSums

__all__ = ["Window", "UploadStats", "Upload", "is_throttle", "list_open_uploads"]

logger = logging.getLogger("tiered_ckpt")

_THROTTLE_TEXT = ("SlowDown", "Service Unavailable", "Too Many Requests", "reduce your request rate", "Throttl")


def is_throttle(exc: BaseException) -> bool:
    """True if ``exc`` is the store asking for fewer requests (503 SlowDown, 429): s3fs turns
    those into ``OSError(EBUSY)``; other clients say so in their message."""
    if isinstance(exc, OSError) and exc.errno == errno.EBUSY:
        return True
    text = f"{type(exc).__name__} {exc}"
    return any(marker in text for marker in _THROTTLE_TEXT)


@dataclass
class Window:
    """How many parts may be in flight at once, shared by the uploads of one remote tier.

    Starts at ``limit``; :meth:`throttled` halves it (at least 1), :meth:`sent` adds
    ``1 / size`` (so one more part per window's worth of parts sent), never past ``limit``.
    Used only on the event loop of the tier's filesystem, so it needs no lock.
    """

    limit: int = 16
    size: float = field(init=False)
    in_flight: int = field(default=0, init=False)
    throttles: int = field(default=0, init=False)
    _changed: asyncio.Condition | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.size = float(self.limit)

    def sent(self) -> None:
        self.size = min(float(self.limit), self.size + 1.0 / self.size)

    def throttled(self) -> None:
        self.throttles += 1
        self.size = max(1.0, self.size / 2)

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def acquire(self) -> None:
        changed = self._condition()
        async with changed:
            await changed.wait_for(lambda: self.in_flight < int(self.size))
            self.in_flight += 1

    async def release(self) -> None:
        changed = self._condition()
        async with changed:
            self.in_flight -= 1
            changed.notify_all()


@dataclass
class UploadStats:
    """What one upload took: requests made, of which throttled, and the checksums the store
    computes of the object (from the bytes sent)."""

    requests: int = 0
    throttled: int = 0
    sums: StoreSums = field(default_factory=lambda: StoreSums(None))


def _read_part(path: Path, offset: int, length: int) -> tuple[bytes, str]:
    """A part's bytes and their CRC32C (base64), read in a worker thread (off the event loop)."""
    with open(path, "rb", buffering=0) as source:
        data = os.pread(source.fileno(), length, offset)
    if len(data) != length:
        raise RemoteError(f"{path}: shorter than when its upload began", transient=False)
    return data, part_crc32c(data)


@dataclass
class Upload:
    """One file's upload to ``s3://bucket/key`` through ``fs`` (an s3fs filesystem), as the
    module doc says: ``await Upload(...).run()``. ``extra`` are arguments of the object's
    creation (``Metadata``). A throttled request is sent again up to ``max_tries`` times,
    backing off from ``backoff_seconds`` (never past ``deadline``, a ``time.monotonic()``
    time); any other error is raised as the client raised it, after the multipart upload
    is aborted. ``verify_source`` (run in a worker thread) raises if the file is not what
    should be uploaded; no object is created unless it returns."""

    fs: Any
    path: Path
    bucket: str
    key: str
    part_bytes: int
    window: Window
    max_tries: int
    backoff_seconds: float
    extra: Mapping[str, Any] = field(default_factory=dict)
    deadline: float | None = None
    verify_source: Callable[[], None] = lambda: None
    stats: UploadStats = field(default_factory=UploadStats, init=False)

    async def call(self, method: str, **kwargs: Any) -> Any:
        """One request, tried again after a backoff while the store throttles it (up to ``max_tries``).

        Throttling is retried here, request by request, and nowhere else: when it persists,
        the error says so and is ``exhausted``, so the tier's retry loop does not multiply
        the tries (it stays transient: the uploader tries the step again later). Other
        errors are raised as the client raised them.
        """
        for attempt in range(1, self.max_tries + 1):
            self.stats.requests += 1
            try:
                return await self.fs._call_s3(method, **kwargs)
            except Exception as exc:
                if not is_throttle(exc):
                    raise
                self.stats.throttled += 1
                self.window.throttled()
                delay = self.backoff_seconds * 2 ** (attempt - 1) * random.random()
                past_deadline = self.deadline is not None and time.monotonic() + delay >= self.deadline
                if attempt == self.max_tries or past_deadline:
                    error = RemoteError(
                        f"{method} of s3://{self.bucket}/{self.key}: throttled by the store {attempt} times "
                        f"({'the deadline came' if past_deadline else 'max_tries reached'}): {exc}",
                        transient=True,
                    )
                    error.tries, error.deadline, error.exhausted = attempt, past_deadline, True
                    raise error from exc
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def run(self) -> UploadStats:
        size = self.path.stat().st_size
        loop = asyncio.get_running_loop()
        if size < 2 * self.part_bytes:
            await loop.run_in_executor(None, self.verify_source)
            data, checksum = await loop.run_in_executor(None, _read_part, self.path, 0, size)
            await self.call(
                "put_object",
                Bucket=self.bucket,
                Key=self.key,
                Body=data,
                ChecksumAlgorithm="CRC32C",
                ChecksumCRC32C=checksum,
                **self.extra,
            )
            etag = await loop.run_in_executor(None, lambda: hashlib.md5(data).hexdigest())
            self.stats.sums = StoreSums(f'"{etag}"', (checksum,))
            return self.stats
        created = await self.call(
            "create_multipart_upload", Bucket=self.bucket, Key=self.key, ChecksumAlgorithm="CRC32C", **self.extra
        )
        upload_id = created["UploadId"]
        checked = loop.run_in_executor(None, self.verify_source)
        try:
            parts = await self._parts(upload_id, size)
            await checked
            await self.call(
                "complete_multipart_upload",
                Bucket=self.bucket,
                Key=self.key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
        except BaseException:  # cancellation (a deadline) included: never leave the upload open
            await asyncio.gather(checked, return_exceptions=True)
            await asyncio.shield(self._abort(upload_id))
            raise
        self.stats.sums = StoreSums(None, tuple(part["ChecksumCRC32C"] for part in parts))
        return self.stats

    async def _parts(self, upload_id: str, size: int) -> list[dict[str, Any]]:
        offsets = range(0, size, self.part_bytes)
        loop = asyncio.get_running_loop()

        async def part(number: int, offset: int) -> dict[str, Any]:
            await self.window.acquire()
            try:
                length = min(self.part_bytes, size - offset)
                data, checksum = await loop.run_in_executor(None, _read_part, self.path, offset, length)
                answer = await self.call(
                    "upload_part",
                    Bucket=self.bucket,
                    Key=self.key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=data,
                    ChecksumAlgorithm="CRC32C",
                    ChecksumCRC32C=checksum,
                )
                self.window.sent()
                return {"PartNumber": number, "ETag": answer["ETag"], "ChecksumCRC32C": checksum}
            finally:
                await self.window.release()

        tasks = [asyncio.ensure_future(part(number, offset)) for number, offset in enumerate(offsets, 1)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _abort(self, upload_id: str) -> None:
        try:
            await self.fs._call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=upload_id)
        except Exception:  # the next start lists and aborts what is left (see RemoteTier.abort_orphans)
            logger.warning("could not abort the multipart upload of s3://%s/%s", self.bucket, self.key, exc_info=True)


def list_open_uploads(fs: Any, bucket: str, prefix: str) -> list[dict[str, Any]]:
    """The multipart uploads open under ``prefix`` in ``bucket`` (every page of the listing),
    through ``fs`` (an s3fs filesystem); none if the bucket does not exist."""
    uploads: list[dict[str, Any]] = []
    arguments: dict[str, Any] = {"Bucket": bucket, "Prefix": f"{prefix}/" if prefix else ""}
    while True:
        try:
            page = fs.call_s3("list_multipart_uploads", **arguments)
        except FileNotFoundError:  # no bucket (yet): nothing left open in it; the upload will say so
            return uploads
        uploads += page.get("Uploads", [])
        if not page.get("IsTruncated"):
            return uploads
        arguments["KeyMarker"], arguments["UploadIdMarker"] = page["NextKeyMarker"], page["NextUploadIdMarker"]
