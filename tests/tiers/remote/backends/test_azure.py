"""The Azure Blob backend (tiered_ckpt.tiers.remote.backends.azure) on Azurite over real HTTP: what Blob
Storage computes of a blob put in one request, blocks it checks on receipt, create-only commits,
both URL schemes through the manager, the endpoint option, and the account key kept out of sight."""

import base64
import hashlib
import logging
import re
import threading

import numpy as np
import pytest

from support.states import assert_states_equal, flip_byte
from support.stores import (
    AZURITE_ACCOUNT,
    AZURITE_KEY,
    FaultInjectingProxy,
    azure_storage_options,
    free_port,
    new_azure_container,
)
from tiered_ckpt import CheckpointManager, ChecksumMismatchError, RemoteError, RemoteOptions, save_sharded
from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.tiers.base import ShardSource
from tiered_ckpt.tiers.remote.backends.azure import AzureBackend
from tiered_ckpt.tiers.remote.tier import RemoteTier, RetryPolicy

PART = 5 << 20


def blob_service(endpoint):
    """A client of our own, beside the library's, to see what Blob Storage holds."""
    from azure.storage.blob import BlobServiceClient

    credential = {"account_name": AZURITE_ACCOUNT, "account_key": AZURITE_KEY}
    return BlobServiceClient(endpoint, credential=credential, retry_total=0)


def blob_of(endpoint, tier, step, record):
    container, _, prefix = tier.backend.root.partition("/")
    return blob_service(endpoint).get_blob_client(container, f"{prefix}/{step_dir_name(step)}/{record.path}")


def b64_md5(data):
    return base64.b64encode(hashlib.md5(data).digest()).decode()


def shard_of(tmp_path, size, step=4):
    states = [{"w": np.random.default_rng(step).integers(0, 255, size, dtype=np.uint8)}]
    manifest = save_sharded(states, tmp_path / "local", step=step)
    return tmp_path / "local" / manifest.shard(0).path, manifest.shard(0)


def proxied(endpoint, **faults):
    """A FaultInjectingProxy in front of Azurite, and the account's blob endpoint through it."""
    proxy = FaultInjectingProxy(endpoint.rsplit("/", 1)[0], **{"failure_rate": 0.0, **faults})
    return proxy, f"{proxy.endpoint}/{AZURITE_ACCOUNT}"


# -- what Blob Storage computes and checks -------------------------------------------------------


def test_a_shard_put_in_one_request_is_confirmed_by_the_md5_blob_storage_computed(azurite_endpoint, tmp_path):
    url, _ = new_azure_container(azurite_endpoint)
    proxy, through = proxied(azurite_endpoint)
    try:
        tier = RemoteTier(url, azure_storage_options(through), part_bytes=PART)
        path, record = shard_of(tmp_path, 300_000)
        landed = tier.land_shard(4, record, ShardSource(path=path))
        assert landed.sent
    finally:
        proxy.close()
    assert [method for method, each in proxy.log if method == "PUT"] == ["PUT"]  # one Put Blob
    properties = blob_of(azurite_endpoint, tier, 4, record).get_blob_properties()
    md5 = b64_md5(path.read_bytes())
    assert base64.b64encode(properties.content_settings.content_md5).decode() == md5  # sent none: Azurite's own
    assert properties.metadata["sha256"] == record.sha256 and properties.size == record.size_bytes
    assert landed.checksum == f"md5:{md5}"


def test_a_larger_shard_goes_up_block_by_block_and_is_confirmed_by_its_md5(azurite_endpoint, tmp_path):
    url, _ = new_azure_container(azurite_endpoint)
    proxy, through = proxied(azurite_endpoint)
    try:
        tier = RemoteTier(url, azure_storage_options(through), part_bytes=PART)
        path, record = shard_of(tmp_path, 11 << 20)
        landed = tier.land_shard(4, record, ShardSource(path=path))
        assert landed.sent
        puts = [each for method, each in proxy.log if method == "PUT"]
        assert [each.split("comp=")[1].split("&")[0] for each in puts] == ["block"] * 3 + ["blocklist"]
        assert tier.backend.requests == 4  # Counting: 3 Put Block, 1 Put Block List
        assert not tier.land_shard(4, record, ShardSource(path=path)).sent  # confirmed intact: nothing sent again
    finally:
        proxy.close()
    blob = blob_of(azurite_endpoint, tier, 4, record)
    blocks = blob.get_block_list("committed")[0]
    assert [block.size for block in blocks] == [PART, PART, record.size_bytes - 2 * PART]
    assert blob.download_blob().readall() == path.read_bytes()
    md5 = b64_md5(path.read_bytes())  # set by the Put Block List (Blob Storage computes none of blocks)
    assert base64.b64encode(blob.get_blob_properties().content_settings.content_md5).decode() == md5
    assert landed.checksum == f"md5:{md5}"


def test_a_block_changed_in_transit_is_refused_by_the_store_and_never_committed(azurite_endpoint, tmp_path):
    """Each block goes with its Content-MD5, which the store checks. Azure refuses a mismatch
    with 400 Md5Mismatch, tried again (test_retry.py); Azurite with 400 InvalidOperation."""
    from azure.core.exceptions import HttpResponseError

    url, _ = new_azure_container(azurite_endpoint)
    proxy, through = proxied(azurite_endpoint, corrupt=("PUT",))
    try:
        tier = RemoteTier(url, azure_storage_options(through), retry=RetryPolicy(max_tries=1), part_bytes=PART)
        path, record = shard_of(tmp_path, 11 << 20)
        with pytest.raises(RemoteError, match="(?i)md5") as caught:
            tier.land_shard(4, record, ShardSource(path=path))
    finally:
        proxy.close()
    refusal = caught.value.__cause__
    assert isinstance(refusal, HttpResponseError) and refusal.status_code == 400
    puts = [each for method, each in proxy.log if method == "PUT"]
    assert puts and all(re.search(r"comp=block(&|$)", each) for each in puts)  # blocks only: never committed
    assert not blob_of(azurite_endpoint, tier, 4, record).exists()


def test_a_shard_changed_in_transit_in_one_request_is_never_confirmed(azurite_endpoint, tmp_path):
    url, _ = new_azure_container(azurite_endpoint)
    proxy, through = proxied(azurite_endpoint, corrupt=("PUT",))
    try:
        tier = RemoteTier(url, azure_storage_options(through), retry=RetryPolicy(max_tries=1), part_bytes=PART)
        path, record = shard_of(tmp_path, 300_000)
        with pytest.raises(RemoteError, match="not confirmed after the upload: the store keeps Content-MD5") as caught:
            tier.land_shard(4, record, ShardSource(path=path))
    finally:
        proxy.close()
    assert caught.value.transient


@pytest.mark.parametrize("size", [300_000, 11 << 20], ids=["one-request", "blocks"])
def test_a_shard_damaged_on_local_disk_is_never_made_a_blob(azure_url, tmp_path, size):
    url, options = azure_url
    tier = RemoteTier(url, options, part_bytes=PART)
    path, record = shard_of(tmp_path, size)
    flip_byte(path, size // 2)
    with pytest.raises(ChecksumMismatchError, match="before its upload"):
        tier.land_shard(4, record, ShardSource(path=path))
    assert not tier.backend.exists(f"{tier.backend.root}/{step_dir_name(4)}/{record.path}")
    assert tier.uncommitted_steps() == []


def test_one_of_16_racing_commits_of_a_manifest_wins(azure_url):
    url, options = azure_url
    tier = RemoteTier(url, options)
    path = f"{tier.backend.root}/{step_dir_name(1)}/manifest.json"
    outcomes, start = {}, threading.Barrier(16)

    def commit(writer):
        start.wait()
        try:
            tier.backend.put_bytes(path, f"writer {writer}".encode(), create_only=True)
            outcomes[writer] = "won"
        except FileExistsError:
            outcomes[writer] = "refused"

    threads = [threading.Thread(target=commit, args=(writer,)) for writer in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [writer for writer, outcome in outcomes.items() if outcome == "won"]
    assert len(outcomes) == 16 and len(winners) == 1
    assert tier.backend.read(path) == f"writer {winners[0]}".encode()


# -- URLs, endpoints, buckets ----------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["az", "abfs"])
def test_either_url_scheme_saves_uploads_and_restores_on_a_fresh_node(azure_url, tmp_path, scheme):
    url, options = azure_url
    url = url.replace("az://", f"{scheme}://")
    states = [{"w": np.arange(1000, dtype=np.float32) + rank, "step": np.array(7)} for rank in range(2)]
    remote = RemoteOptions(url, storage_options=options)
    with CheckpointManager(tmp_path / "a", world_size=2, remote=remote) as manager:
        manager.save(7, states)
        manager.wait(uploaded=True)
    tier = RemoteTier(url, options)
    assert isinstance(tier.backend.inner, AzureBackend) and tier.steps() == [7]
    assert all(kept.startswith("md5:") for kept in tier.read_manifest(7).store_checksums.values())
    with CheckpointManager(tmp_path / "b", world_size=2, remote=remote) as fresh:
        result = fresh.restore()
    assert result.step == 7 and set(result.sources.values()) == {"remote"}
    assert_states_equal(states, result.states)


def test_the_endpoint_option_names_the_account_and_wins_over_the_storage_options(azure_url, tmp_path, monkeypatch):
    url, direct = azure_url
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", AZURITE_KEY)  # adlfs's own chain, not the options
    endpoint = direct["endpoint_url"]
    options = {"account_name": AZURITE_ACCOUNT, "endpoint_url": f"http://127.0.0.1:{free_port()}/{AZURITE_ACCOUNT}"}
    remote = RemoteOptions(url, storage_options=options, endpoint_url=endpoint)
    with CheckpointManager(tmp_path, world_size=1, remote=remote) as manager:
        manager.save(1, [{"w": np.arange(3.0)}])
        manager.wait(uploaded=True)
        assert manager.remote_steps() == [1]


def test_a_connection_string_reaches_the_account_it_names(azure_url, tmp_path):
    url, options = azure_url
    connection = (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
        f"BlobEndpoint={options['endpoint_url']};"
    )
    tier = RemoteTier(url, {"connection_string": connection})
    path, record = shard_of(tmp_path, 1000)
    assert tier.land_shard(4, record, ShardSource(path=path)).sent
    assert tier.backend.read(f"{tier.backend.root}/{step_dir_name(4)}/{record.path}") == path.read_bytes()
    assert AZURITE_KEY not in repr(tier) and AZURITE_KEY not in repr(tier.backend)


def test_a_missing_container_and_a_wrong_key_are_refused_naming_the_container(azurite_endpoint, tmp_path):
    url, options = new_azure_container(azurite_endpoint)
    container = url.removeprefix("az://").split("/")[0]
    with pytest.raises(RemoteError, match="the bucket 'tiered-no-such-container' does not exist") as caught:
        RemoteTier("az://tiered-no-such-container/run", options).check_bucket()
    assert not caught.value.transient and caught.value.tries == 1
    wrong = {**options, "account_key": base64.b64encode(b"not the key" * 6).decode()}
    with pytest.raises(RemoteError, match=f"access to the bucket '{container}' is denied") as caught:
        CheckpointManager(tmp_path, world_size=1, remote=RemoteOptions(url, storage_options=wrong))
    assert not caught.value.transient and caught.value.tries == 1


def test_a_store_that_always_fails_costs_max_tries_requests(azurite_endpoint):
    """The Azure SDK's own retries are off (the library turns them off): one request per try."""
    url, _ = new_azure_container(azurite_endpoint)
    proxy, through = proxied(azurite_endpoint, failure_rate=1.0)
    try:
        tier = RemoteTier(url, azure_storage_options(through), retry=RetryPolicy(max_tries=3, backoff_seconds=0))
        with pytest.raises(RemoteError, match="check its bucket") as caught:
            tier.check_bucket()
    finally:
        proxy.close()
    assert caught.value.transient and caught.value.tries == 3 and proxy.requests == 3


@pytest.mark.slow
def test_a_store_that_never_answers_a_put_fails_it_as_transient(azurite_endpoint, tmp_path):
    """The request timeout reaches the SDK client the library opens (its own is minutes)."""
    url, _ = new_azure_container(azurite_endpoint)
    proxy, through = proxied(azurite_endpoint, stall=("PUT",))
    outcome = []
    try:
        tier = RemoteTier(url, azure_storage_options(through), retry=RetryPolicy(max_tries=1, timeout_seconds=1))
        path, record = shard_of(tmp_path, 1000)

        def land():
            try:
                tier.land_shard(4, record, ShardSource(path=path))
            except RemoteError as exc:
                outcome.append(exc)

        worker = threading.Thread(target=land, daemon=True)
        worker.start()
        worker.join(60)  # a guard against a hang, not a timing
    finally:
        proxy.close()
    assert not worker.is_alive() and len(outcome) == 1
    assert outcome[0].transient and "ServiceResponseTimeoutError" in str(outcome[0])


# -- the account key stays out of sight ------------------------------------------------------


def test_the_account_key_never_shows_in_reprs_errors_or_logs(azure_url, caplog):
    url, options = azure_url
    caplog.set_level(logging.DEBUG)
    tier = RemoteTier(url, options)
    shown = [repr(tier), repr(tier.backend), repr(RemoteOptions(url, storage_options=options))]
    closed = {**options, "endpoint_url": f"http://127.0.0.1:{free_port()}/{AZURITE_ACCOUNT}"}
    with pytest.raises(RemoteError, match="transient error ServiceRequestError") as refused:
        RemoteTier(url, closed, retry=RetryPolicy(max_tries=2, backoff_seconds=0)).check_bucket()
    malformed = {"connection_string": f"AccountKey={AZURITE_KEY};not a connection string"}
    with pytest.raises(RemoteError, match=f"cannot open {url}") as unopened:
        RemoteTier(url, malformed)
    shown += [str(refused.value), str(unopened.value), *(record.getMessage() for record in caplog.records)]
    assert refused.value.tries == 2
    assert any(record.name.startswith("azure.") for record in caplog.records)  # the SDK logs each request
    for text in shown:
        assert AZURITE_KEY not in text and AZURITE_KEY[:20] not in text
