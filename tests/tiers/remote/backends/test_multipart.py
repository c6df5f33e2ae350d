"""The S3 upload client (tiered_ckpt.tiers.remote.backends.multipart) against a fake client that fails on command."""

from __future__ import annotations

import asyncio
import base64
import errno
import hashlib

import crc32c
import pytest

from tiered_ckpt import ChecksumMismatchError, RemoteError
from tiered_ckpt.tiers.remote.backends.multipart import Upload, Window, is_throttle

PART = 1024


class FakeS3:
    """An s3fs stand-in: records every request; ``throttle`` decides, per request, to answer SlowDown."""

    def __init__(self, throttle=lambda method, count: False, fail_part: int | None = None, hang_part=None) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.throttle, self.fail_part, self.hang_part = throttle, fail_part, hang_part
        self.in_flight = self.most_in_flight = 0
        self.objects: dict[str, bytes] = {}
        self.parts: dict[int, bytes] = {}

    async def _call_s3(self, method: str, **kwargs):
        self.calls.append((method, kwargs))
        if self.throttle(method, len(self.calls)):
            raise OSError(errno.EBUSY, "Please reduce your request rate.")
        if method == "put_object":
            self.objects[kwargs["Key"]] = kwargs["Body"]
            return {"ETag": '"x"'}
        if method == "create_multipart_upload":
            return {"UploadId": "u1"}
        if method == "upload_part":
            number = kwargs["PartNumber"]
            if number == self.fail_part:
                raise PermissionError("AccessDenied")
            if number == self.hang_part:
                await asyncio.Event().wait()
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            await asyncio.sleep(0)  # let the other parts in the window start
            self.in_flight -= 1
            assert kwargs["ChecksumCRC32C"] == crc32c_b64(kwargs["Body"])
            self.parts[number] = kwargs["Body"]
            return {"ETag": f'"e{number}"'}
        if method == "complete_multipart_upload":
            numbers = [part["PartNumber"] for part in kwargs["MultipartUpload"]["Parts"]]
            assert numbers == sorted(self.parts) == list(range(1, len(numbers) + 1))
            self.objects[kwargs["Key"]] = b"".join(self.parts[n] for n in numbers)
            return {}
        if method == "abort_multipart_upload":
            return {}
        raise AssertionError(method)

    def methods(self) -> list[str]:
        return [method for method, _ in self.calls]


def crc32c_b64(data: bytes) -> str:
    return base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()


def composite_crc32c(path, part_bytes):
    """The ChecksumCRC32C S3 reports for ``path`` sent as parts of ``part_bytes`` (or whole, if small)."""
    data = path.read_bytes()
    if len(data) < 2 * part_bytes:
        return crc32c_b64(data)
    digests = [crc32c.crc32c(data[i : i + part_bytes]).to_bytes(4, "big") for i in range(0, len(data), part_bytes)]
    return f"{crc32c_b64(b''.join(digests))}-{len(digests)}"


def run(fs, path, window=None, max_tries=5, **options):
    window = window or Window(4)
    upload = Upload(fs, path, "b", "k", part_bytes=PART, window=window, max_tries=max_tries, backoff_seconds=0,
                    **options)  # fmt: skip
    return asyncio.run(upload.run())


@pytest.fixture
def big(tmp_path):
    path = tmp_path / "shard"
    path.write_bytes(bytes(range(256)) * 40)  # 10 parts of 1024 bytes
    return path


def test_a_large_file_goes_up_in_parts_within_the_window_with_the_composite_checksum(big):
    fs = FakeS3()
    stats = run(fs, big, window=Window(3))
    assert fs.objects["k"] == big.read_bytes()
    assert fs.methods().count("upload_part") == 10 and 1 < fs.most_in_flight <= 3
    assert stats.requests == 12 and stats.throttled == 0
    assert stats.sums.kept == "crc32c:" + composite_crc32c(big, PART) and stats.sums.kept.endswith("-10")
    assert stats.sums.etag is None  # a multipart object is confirmed by its CRC32C, not its ETag
    created = fs.calls[0][1]
    assert created["ChecksumAlgorithm"] == "CRC32C"


def test_a_small_file_is_one_put_with_its_crc32c_and_the_md5_the_store_takes_for_its_etag(tmp_path):
    path = tmp_path / "small"
    path.write_bytes(b"x" * (2 * PART - 1))
    fs = FakeS3()
    stats = run(fs, path, extra={"Metadata": {"sha256": "abc"}})
    assert fs.methods() == ["put_object"] and fs.calls[0][1]["Metadata"] == {"sha256": "abc"}
    assert fs.calls[0][1]["ChecksumCRC32C"] == crc32c_b64(path.read_bytes())
    assert stats.sums.kept == "crc32c:" + composite_crc32c(path, PART)
    assert stats.sums.etag == f'"{hashlib.md5(path.read_bytes()).hexdigest()}"'


def refuse(path):
    def verify_source():
        raise ChecksumMismatchError(f"{path}: damaged")

    return verify_source


def test_a_source_found_damaged_while_its_parts_go_up_is_never_completed(big):
    fs = FakeS3()
    with pytest.raises(ChecksumMismatchError, match="damaged"):
        run(fs, big, verify_source=refuse(big))
    assert fs.methods()[-1] == "abort_multipart_upload" and "complete_multipart_upload" not in fs.methods()
    assert "k" not in fs.objects


def test_a_small_source_found_damaged_is_never_sent(tmp_path):
    path = tmp_path / "small"
    path.write_bytes(b"x" * 10)
    fs = FakeS3()
    with pytest.raises(ChecksumMismatchError):
        run(fs, path, verify_source=refuse(path))
    assert fs.calls == []


def test_throttling_halves_the_window_and_each_part_sent_grows_it_back(big):
    window = Window(8)
    fs = FakeS3(throttle=lambda method, count: method == "upload_part" and count % 3 == 0)  # every third request
    stats = run(fs, big, window=window)
    assert fs.objects["k"] == big.read_bytes()
    assert stats.throttled == window.throttles > 0
    assert stats.requests == len(fs.calls) <= 5 * 12  # at most max_tries per request: tries never multiply


def test_the_window_halves_on_throttling_and_grows_by_one_part_per_window_sent():
    window = Window(8)
    window.throttled()
    window.throttled()
    assert window.size == 2
    window.sent()
    window.sent()
    assert window.size == pytest.approx(2 + 1 / 2 + 1 / 2.5)  # about one more part per window's worth
    for _ in range(1000):
        window.sent()
    assert window.size == 8  # never past the limit
    for _ in range(20):
        window.throttled()
    assert window.size == 1 and window.throttles == 22  # never below one part


def test_a_store_that_keeps_throttling_fails_the_upload_after_max_tries_and_aborts_it(big):
    fs = FakeS3(throttle=lambda method, count: method == "upload_part")
    with pytest.raises(RemoteError, match="throttled by the store 3 times") as caught:
        run(fs, big, max_tries=3)
    assert caught.value.tries == 3 and caught.value.exhausted  # the tier's retry loop does not multiply it
    assert caught.value.transient  # the uploader tries the step again later
    assert fs.methods()[-1] == "abort_multipart_upload" and "complete_multipart_upload" not in fs.methods()


def test_a_refused_part_aborts_the_upload_and_raises_the_clients_error(big):
    fs = FakeS3(fail_part=4)
    with pytest.raises(PermissionError):
        run(fs, big)
    assert fs.methods()[-1] == "abort_multipart_upload" and "k" not in fs.objects


def test_a_cancelled_upload_is_aborted_too(big):
    fs = FakeS3(hang_part=2)

    async def cut_short():
        upload = asyncio.ensure_future(
            Upload(fs, big, "b", "k", part_bytes=PART, window=Window(4), max_tries=5, backoff_seconds=0).run()
        )
        while "upload_part" not in fs.methods():
            await asyncio.sleep(0)
        upload.cancel()  # what a deadline does (fsspec cancels the coroutine)
        with pytest.raises(asyncio.CancelledError):
            await upload

    asyncio.run(cut_short())
    assert fs.methods()[-1] == "abort_multipart_upload"


def test_only_the_stores_requests_to_slow_down_count_as_throttling():
    assert is_throttle(OSError(errno.EBUSY, "Please reduce your request rate."))
    assert is_throttle(RuntimeError("An error occurred (SlowDown) when calling the PutObject operation"))
    assert not is_throttle(TimeoutError('Read timeout on endpoint URL: "http://127.0.0.1:42981/b/k"'))
    assert not is_throttle(PermissionError("AccessDenied"))
