"""The Azure Blob Storage backend (``az://container/prefix``, ``abfs://``), through adlfs and the
Azure SDK under it: the sha256 as blob metadata, the blob's Content-MD5 as the store's checksum.

What Blob Storage guarantees, and how each request uses it:

- A shard below ``2 * part_bytes`` goes up in one Put Blob sent without an MD5: Blob Storage
  then computes the MD5 of the bytes it received and keeps it as the blob's ``Content-MD5``.
  After the PUT it is compared with the file's, so bytes changed in transit are never
  confirmed, and it is what the remote manifest records (``md5:<base64>``).
- A larger shard goes up in blocks of ``part_bytes`` (Put Block; at most ``part_concurrency``
  in flight across this backend's uploads), then one Put Block List. Each block is sent with
  its Content-MD5, and Blob Storage refuses a block whose bytes differ from it (400
  ``Md5Mismatch``, transient: the upload is tried again). Blob Storage computes no checksum of
  a blob committed from blocks: its ``Content-MD5`` is the one Put Block List sets, kept but
  not checked by the store. So the blocks are hashed as they are read to be sent, in file
  order: that MD5 and the check of the file against its record (size, xxh3-64) are of exactly
  the bytes sent, and the block list is committed only once the check passed. A failed
  upload leaves uncommitted blocks only, which never replace a blob and which Blob Storage
  discards after a week (there is no open upload to list or abort).
- A small object written create-only (the remote manifest) is a Put Blob with
  ``If-None-Match: *``, refused (409) when the blob exists.

Blob Storage also computes a CRC64 of a block or a Put Blob (``x-ms-content-crc64``), but keeps
none with a blob, so the MD5 is what is compared and recorded.

The SDK client adlfs opens is replaced by one of the same account URL (``endpoint_url``, if
given in the storage options, replaces it: ``http://127.0.0.1:10000/devstoreaccount1`` for
Azurite) and credential, whose own retries are off (ours are the only ones) and whose
requests give up after the retry policy's ``timeout_seconds``. adlfs keeps no listings
(``use_listings_cache=False``): a commit marker is never looked up in a stale listing.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import hashlib
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit

import xxhash
from fsspec.asyn import sync

from tiered_ckpt.format.manifest import ShardRecord
from tiered_ckpt.io.hashing import ShardDigest
from tiered_ckpt.tiers.remote.backends.base import SHA256_METADATA_KEY, Head, Sent
from tiered_ckpt.tiers.remote.backends.fsspec import FsspecBackend, seconds_left
from tiered_ckpt.tiers.remote.backends.multipart import Window
from tiered_ckpt.tiers.remote.checksums import StoreSums, hash_for_store
from tiered_ckpt.tiers.remote.retry import RetryPolicy

__all__ = ["AzureBackend", "MAX_PUT_BLOB_BYTES", "content_md5"]

MAX_PUT_BLOB_BYTES = 5000 << 20  # the most one Put Blob takes (API version 2019-12-12 and later)
_DELETE_CONCURRENCY = 16


def content_md5(head: Head) -> str | None:
    """The blob's Content-MD5 (base64) from :meth:`AzureBackend.head`'s answer, None if it has none."""
    kept = head.answer.get("content_md5")
    return kept if isinstance(kept, str) else None


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


@contextmanager
def _translated(path: str) -> Iterator[None]:
    """The SDK's errors of a missing blob or container, an existing blob and a refused credential
    as the OSErrors fsspec code raises (the tier tells permanent from transient by them)."""
    from azure.core.exceptions import HttpResponseError, ResourceExistsError, ResourceNotFoundError

    try:
        yield
    except ResourceNotFoundError as exc:
        raise FileNotFoundError(errno.ENOENT, _code(exc, "not found"), path) from exc
    except ResourceExistsError as exc:
        raise FileExistsError(errno.EEXIST, _code(exc, "exists"), path) from exc
    except HttpResponseError as exc:
        if exc.status_code in (401, 403):
            raise PermissionError(errno.EACCES, _code(exc, str(exc.reason)), path) from exc
        raise


def _code(exc: Exception, otherwise: str) -> str:
    """Blob Storage's error code of ``exc`` (which the SDK adds to its errors), or ``otherwise``."""
    code = getattr(exc, "error_code", None)
    return str(getattr(code, "value", code) or otherwise)


def _service_client(opened: Any, endpoint: str | None, retry: RetryPolicy) -> Any:
    """A client of ``opened``'s account URL (or ``endpoint``, a SAS token kept) and credential,
    without the SDK's own retries, its requests timed out by ``retry``, one Put Blob up to
    :data:`MAX_PUT_BLOB_BYTES` (the backend decides what goes up in blocks)."""
    from azure.storage.blob.aio import BlobServiceClient

    account_url = opened.url
    if endpoint is not None:
        sas = urlsplit(opened.url).query
        account_url = f"{endpoint.rstrip('/')}?{sas}" if sas else endpoint.rstrip("/")
    return BlobServiceClient(
        account_url,
        credential=opened.credential,
        retry_total=0,
        connection_timeout=retry.timeout_seconds,
        read_timeout=retry.timeout_seconds,
        max_single_put_size=MAX_PUT_BLOB_BYTES,
    )


def _read_hashing(source: BinaryIO, size: int, md5: Any, whole: Any) -> bytes:
    """The next ``size`` bytes of ``source`` (fewer at its end), added to both running hashes."""
    data = source.read(size)
    md5.update(data)
    whole.update(data)
    return data


class AzureBackend(FsspecBackend):
    """A container (and prefix) on Azure Blob Storage, or a store speaking its API."""

    # create-only: put_bytes sends If-None-Match: *, refused (409) if the blob exists
    capabilities = replace(FsspecBackend.capabilities, create_only_commit=True, store_checksums=True)
    keeps_metadata = True
    BUCKET_SCHEME = "az"
    READ_AHEAD = True

    def __init__(self, url: str, fs: Any, root: str, *, retry: RetryPolicy, part_bytes: int, part_concurrency: int):
        super().__init__(url, fs, root, retry=retry, part_bytes=part_bytes, part_concurrency=part_concurrency)
        self.window = Window(part_concurrency)

    @classmethod
    def client_options(
        cls, options: Mapping[str, Any], retry: RetryPolicy, *, connections: int | None = None
    ) -> dict[str, Any]:
        merged = super().client_options(options, retry, connections=connections)
        merged["skip_instance_cache"] = True  # its SDK client is replaced: never one another tier may hold
        merged.setdefault("use_listings_cache", False)
        return merged

    @classmethod
    def open_filesystem(
        cls, url: str, options: Mapping[str, Any], retry: RetryPolicy, *, connections: int | None = None
    ) -> tuple[Any, str]:
        rest = dict(options)
        endpoint = rest.pop("endpoint_url", None)
        fs, root = super().open_filesystem(url, rest, retry, connections=connections)
        opened, fs.service_client = fs.service_client, _service_client(fs.service_client, endpoint, retry)
        sync(fs.loop, opened.close)  # it never made a request
        return fs, root

    def _blob(self, path: str) -> Any:
        container, key, _version = self.fs.split_path(path)
        return self.fs.service_client.get_blob_client(container, key)

    # -- shards -----------------------------------------------------------------------

    def sums(self, local_path: Path, record: ShardRecord) -> StoreSums | None:
        hashes = hash_for_store(local_path, record, chunk_bytes=self.part_bytes, md5=True, split=False)
        assert hashes.md5 is not None
        return StoreSums(None, md5=_b64(hashes.md5))

    def put_shard(self, local_path: Path, path: str, record: ShardRecord, *, deadline: float | None) -> Sent:
        sent: Sent = sync(
            self.fs.loop, self._put_shard, local_path, path, record, **self._limit(seconds_left(deadline))
        )
        return sent

    async def _put_shard(self, local_path: Path, path: str, record: ShardRecord) -> Sent:
        metadata = {SHA256_METADATA_KEY: record.sha256}
        loop = asyncio.get_running_loop()
        with _translated(path):
            async with self._blob(path) as blob:
                if record.size_bytes >= 2 * self.part_bytes:
                    return await self._put_blocks(blob, local_path, record, metadata)
                data, md5 = await loop.run_in_executor(None, self._read_checked, local_path, record)
                await blob.upload_blob(data, length=len(data), overwrite=True, metadata=metadata)
                return Sent(StoreSums(None, md5=md5))

    @staticmethod
    def _read_checked(local_path: Path, record: ShardRecord) -> tuple[bytes, str]:
        """The file's bytes and their MD5 (base64), once they are checked against ``record``."""
        with open(local_path, "rb") as source:
            data = source.read(record.size_bytes + 1)  # a longer file is refused, never read whole
        record.verify(ShardDigest(len(data), "", xxhash.xxh3_64(data).hexdigest()), f"{local_path} (before its upload)")
        return data, _b64(hashlib.md5(data).digest())

    async def _put_blocks(self, blob: Any, local_path: Path, record: ShardRecord, metadata: dict[str, str]) -> Sent:
        """Put Block each ``part_bytes`` of the file, read in order and hashed as read, then Put
        Block List once the bytes read are the record's; on any failure, no block list."""
        from azure.storage.blob import BlobBlock, ContentSettings

        loop = asyncio.get_running_loop()
        md5, whole, token = hashlib.md5(), xxhash.xxh3_64(), uuid.uuid4().hex
        ids: list[str] = []
        tasks: list[asyncio.Future[None]] = []

        async def stage(block_id: str, data: bytes) -> None:
            try:
                await blob.stage_block(block_id, data, length=len(data), validate_content=True)
                self.window.sent()
            finally:
                await self.window.release()

        size = 0
        try:
            with open(local_path, "rb", buffering=0) as source:
                while size <= record.size_bytes:
                    for task in tasks:  # a block already refused ends the upload now
                        if task.done() and not task.cancelled() and task.exception() is not None:
                            await task
                    await self.window.acquire()
                    try:
                        data = await loop.run_in_executor(None, _read_hashing, source, self.part_bytes, md5, whole)
                    except BaseException:
                        await self.window.release()
                        raise
                    if not data:
                        await self.window.release()
                        break
                    size += len(data)
                    ids.append(_b64(f"{token}-{len(ids):05d}".encode()))  # one length for every block of a blob
                    tasks.append(asyncio.ensure_future(stage(ids[-1], data)))
            await asyncio.gather(*tasks)
        except BaseException:  # cancellation (a deadline) included: stop every block still going up
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        record.verify(ShardDigest(size, "", whole.hexdigest()), f"{local_path} (before its upload)")
        digest = md5.digest()
        await blob.commit_block_list(
            [BlobBlock(block_id=block_id) for block_id in ids],
            content_settings=ContentSettings(content_md5=bytearray(digest)),
            metadata=metadata,
        )
        return Sent(StoreSums(None, md5=_b64(digest)), requests=len(ids) + 1)

    # -- objects ------------------------------------------------------------------------

    def put_bytes(self, path: str, data: bytes, *, create_only: bool = False, timeout: float | None = None) -> None:
        """One Put Blob; ``create_only``: with ``If-None-Match: *`` (FileExistsError if the blob exists)."""
        sync(self.fs.loop, self._put_bytes, path, data, create_only, **self._limit(timeout))

    async def _put_bytes(self, path: str, data: bytes, create_only: bool) -> None:
        with _translated(path):
            async with self._blob(path) as blob:
                await blob.upload_blob(data, length=len(data), overwrite=not create_only)

    def head(self, path: str, *, timeout: float | None = None) -> Head:
        head: Head = sync(self.fs.loop, self._head, path, **self._limit(timeout))
        return head

    async def _head(self, path: str) -> Head:
        with _translated(path):
            async with self._blob(path) as blob:
                properties = await blob.get_blob_properties()
        md5 = properties.content_settings.content_md5
        answer = {"content_md5": _b64(bytes(md5)) if md5 else None, "etag": properties.etag}
        return Head(int(properties.size), (properties.metadata or {}).get(SHA256_METADATA_KEY), answer)

    def kept_checksum(self, head: Head, algorithm: str) -> str | None:
        kept = content_md5(head)
        return f"md5:{kept}" if algorithm == "md5" and kept else None

    def store_problem(self, head: Head, sums: StoreSums) -> str | None:
        kept = content_md5(head)
        if sums.md5 is not None and kept != sums.md5:
            return f"the store keeps Content-MD5 {kept} for the bytes it holds, expected {sums.md5}"
        return None

    def size(self, path: str, *, timeout: float | None = None) -> int:
        return self.head(path, timeout=timeout).size

    def exists(self, path: str) -> bool:
        found: bool = sync(self.fs.loop, self._exists, path)
        return found

    async def _exists(self, path: str) -> bool:
        with _translated(path):
            async with self._blob(path) as blob:
                found: bool = await blob.exists()
                return found

    def delete(self, paths: list[str]) -> None:
        """Delete Blob naming each blob, up to 16 at once (a blob batch is refused by accounts
        with a hierarchical namespace, which ``abfs://`` URLs often name)."""
        sync(self.fs.loop, self._delete, paths)

    async def _delete(self, paths: list[str]) -> None:
        from azure.core.exceptions import ResourceNotFoundError

        limit = asyncio.Semaphore(_DELETE_CONCURRENCY)

        async def delete(path: str) -> None:
            with _translated(path):
                async with limit, self._blob(path) as blob:
                    try:
                        await blob.delete_blob()
                    except ResourceNotFoundError:
                        pass

        results = await asyncio.gather(*map(delete, paths), return_exceptions=True)
        failed = [result for result in results if isinstance(result, BaseException)]
        if failed:
            raise failed[0]

    def check_bucket(self) -> None:
        self._check_bucket_by(lambda container, prefix: sync(self.fs.loop, self._list_one, container, prefix), "az")

    async def _list_one(self, container: str, prefix: str) -> None:
        with _translated(container):
            async with self.fs.service_client.get_container_client(container) as client:
                async for _page in client.list_blobs(name_starts_with=prefix or None, results_per_page=1).by_page():
                    break
