"""The object stores the tests run on: credentials and options for moto, fake-gcs-server and Azurite, the stores each
fixture gives, and the fault-injecting proxy and stoppable server in front of them."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

S3_TEST_KEY = "AKIATIEREDCKPTTESTKEY"
S3_TEST_SECRET = "tiered-ckpt-test-secret-never-to-be-logged"


def s3_storage_options(endpoint: str) -> dict:
    return {
        "key": S3_TEST_KEY,
        "secret": S3_TEST_SECRET,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "skip_instance_cache": True,
    }


def write_s3_config(
    path: Path, local_dir: Path, url: str, endpoint: str, *, local_keep: str = "", remote_keep: str = ""
) -> Path:
    """Write a TOML config for ``local_dir`` and the moto bucket at ``url``; credentials stay out of it."""
    path.write_text(
        f"[local]\ndir = '{local_dir}'\n{local_keep}\n[remote]\nurl = '{url}'\n{remote_keep}\n"
        f"[remote.storage_options]\nendpoint_url = '{endpoint}'\n"
        "[remote.storage_options.client_kwargs]\nregion_name = 'us-east-1'\n"
    )
    return path


def s3_credentials_env() -> dict[str, str]:
    """This process's environment plus the test credentials, as the store's own chain reads them."""
    return {**os.environ, "AWS_ACCESS_KEY_ID": S3_TEST_KEY, "AWS_SECRET_ACCESS_KEY": S3_TEST_SECRET}


def new_s3_bucket(endpoint: str, prefix: str = "tiered-test") -> tuple[str, dict]:
    """Create a fresh bucket on the moto server at ``endpoint``; return (url, storage_options)."""
    import uuid

    import boto3

    bucket = f"{prefix}-{uuid.uuid4().hex[:16]}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=S3_TEST_KEY,
        aws_secret_access_key=S3_TEST_SECRET,
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=bucket)
    return f"s3://{bucket}/run", s3_storage_options(endpoint)


REMOTES = ("memory", "s3", "gcs", "azure", "file")  # the remote_url fixture's values, in its order
CLOUDS = ("s3", "gcs", "azure")  # cloud_url's


def with_slow(values: Sequence[str], *slow: str) -> list[Any]:
    """``values`` as parameters with those in ``slow`` marked slow, for a test that is slow on some
    stores only: ``@pytest.mark.parametrize("remote_url", with_slow(REMOTES, "s3"), indirect=True)``."""
    return [pytest.param(value, marks=pytest.mark.slow) if value in slow else value for value in values]


class FaultInjectingProxy:
    """An HTTP proxy on a free loopback port in front of ``upstream`` that answers
    ``failure_rate`` of the requests (of ``methods`` only, if given) with ``503 SlowDown``
    instead of forwarding them. ``requests`` counts every request it received, ``log`` lists
    each one's method and path. Requests
    whose method is in ``corrupt`` are forwarded with one byte of their body flipped (bytes
    changed in transit); those in ``stall`` are read and never answered (while ``stall`` names their method), or
    with ``stall_paths`` only those whose path holds one of its strings (``".safetensors"``:
    shard uploads). ``failure_rate``, ``fail_next`` (the next requests answered 503) and ``stall``
    are attributes a test may change while it runs.

    Which requests fail comes from a seeded generator, so the sequence of decisions is
    the same in every run (which request meets which decision depends on thread timing).
    """

    def __init__(
        self,
        upstream: str,
        failure_rate: float = 0.3,
        seed: int = 1234,
        methods: tuple[str, ...] | None = None,
        corrupt: tuple[str, ...] = (),
        stall: tuple[str, ...] = (),
        stall_paths: tuple[str, ...] = (),
    ) -> None:
        import http.client
        import http.server
        import random
        import threading
        import urllib.parse

        target = urllib.parse.urlsplit(upstream)
        proxy = self
        self._closed = threading.Event()
        self.stall = stall
        self.failure_rate = failure_rate
        self.fail_next = 0  # the next this many requests are answered 503 whatever the rate
        self.requests = 0
        self.log: list[tuple[str, str]] = []  # (method, path) of every request received
        self.injected = 0
        self._lock = threading.Lock()
        decisions = random.Random(seed)

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if self.command in proxy.stall and (not stall_paths or any(p in self.path for p in stall_paths)):
                    while self.command in proxy.stall and not proxy._closed.wait(0.05):
                        pass  # never answered: once the stall is lifted, the connection just closes
                    self.close_connection = True
                    return
                if self.command in corrupt and body:
                    flipped = bytearray(body)
                    flipped[len(body) // 2] ^= 0xFF
                    body = bytes(flipped)
                with proxy._lock:
                    proxy.requests += 1
                    proxy.log.append((self.command, self.path))
                    fail = decisions.random() < proxy.failure_rate and (methods is None or self.command in methods)
                    fail = fail or proxy.fail_next > 0
                    proxy.fail_next = max(0, proxy.fail_next - 1)
                    proxy.injected += fail
                if fail:
                    error = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    if self.command != "HEAD":  # a HEAD answer has no body
                        self.wfile.write(error)
                    return
                connection = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                connection.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in ("connection", "keep-alive", "proxy-connection", "transfer-encoding"):
                        connection.putheader(name, value)
                connection.endheaders(body)
                response = connection.getresponse()
                data = response.read()
                self.send_response(response.status, response.reason)
                for name, value in response.getheaders():
                    if name.lower() not in ("connection", "keep-alive", "transfer-encoding", "content-length"):
                        self.send_header(name, value)
                # A HEAD answer carries the object's length, not that of its (empty) body.
                length = response.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length or "0")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                connection.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._closed.set()
        self._server.shutdown()
        self._server.server_close()


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running_emulator(command: list[str], probe: str, name: str) -> Iterator[None]:
    """Run an emulator's ``command`` until the context ends, entering it once ``probe`` (a URL)
    answers at all: an HTTP error status is an answer too."""
    import time
    import urllib.error
    import urllib.request

    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:  # readiness poll, not a timing assumption: proceed as soon as it answers
            try:
                urllib.request.urlopen(probe, timeout=2).read()
                break
            except urllib.error.HTTPError:  # it answers (Azurite: 403, the request is not signed)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not start") from None
                time.sleep(0.05)
        yield
    finally:
        server.terminate()
        server.wait()


# Azurite's well-known development account (Microsoft publishes both; they open nothing else).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
# Where .ci/run installs Azurite (npm), if `azurite-blob` is not on the PATH.
AZURITE_BIN = Path(__file__).resolve().parents[2] / ".ci-node" / "node_modules" / ".bin" / "azurite-blob"


def azure_storage_options(endpoint: str) -> dict:
    """adlfs's options for the Azurite account whose blob endpoint is ``endpoint``."""
    return {
        "account_name": AZURITE_ACCOUNT,
        "account_key": AZURITE_KEY,
        "endpoint_url": endpoint,
        "skip_instance_cache": True,
    }


def new_azure_container(endpoint: str) -> tuple[str, dict]:
    """Create a fresh container on the Azurite at ``endpoint``; return (url, storage_options)."""
    import uuid

    from azure.storage.blob import BlobServiceClient

    container = f"tiered-test-{uuid.uuid4().hex[:16]}"
    credential = {"account_name": AZURITE_ACCOUNT, "account_key": AZURITE_KEY}
    with BlobServiceClient(endpoint, credential=credential, retry_total=0) as client:
        client.create_container(container)
    return f"az://{container}/run", azure_storage_options(endpoint)


class StoppableS3:
    """moto's S3 server on a loopback port of its own that a test can stop (a real outage:
    connection refused) and start again on the same port, with the buckets it held (moto
    keeps them per process: every moto server of the test process sees the same buckets)."""

    def __init__(self) -> None:
        import logging

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server = None
        self.start()

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


def save_hashed_and_compressed(directory: Path, url: str, options: dict) -> list[dict]:
    """Step 1 of 2 ranks saved in ``directory`` and committed in the bucket at ``url`` with hashed
    key prefixes and zstd objects (names a reader's default options would not find); the states."""
    import numpy as np

    from tiered_ckpt import CheckpointManager, RemoteOptions

    states = [{"w": np.arange(50_000, dtype=np.float32) + rank} for rank in range(2)]
    writer = RemoteOptions(url, storage_options=options, layout="hashed", compression="zstd")
    with CheckpointManager(directory, world_size=2, remote=writer) as manager:
        manager.save(1, states, blocking=True)
        manager.wait(uploaded=True)
    return states


def save_two_incremental_steps(directory: Path, url: str, options: dict) -> None:
    """Steps 1 and 2 of one rank saved in ``directory`` and committed in the bucket at ``url`` as
    :func:`save_hashed_and_compressed` commits its step; step 2 references step 1's file for the
    arrays it left unchanged."""
    import numpy as np

    from tiered_ckpt import CheckpointManager, LocalOptions, RemoteOptions

    base = {f"layer{i}": np.full((32, 64), i, np.float32) for i in range(3)}
    writer = RemoteOptions(url, storage_options=options, layout="hashed", compression="zstd")
    with CheckpointManager(LocalOptions(directory), world_size=1, remote=writer) as manager:
        for step in (1, 2):
            manager.save(step, {"base": base, "adapter": np.full((32, 64), step, np.float32)}, blocking=True)
        manager.wait(uploaded=True)
