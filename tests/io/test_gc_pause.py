import gc
import json
import threading

import numpy as np
import pytest
from test_manifest import valid_document

from tiered_ckpt import ShardManifest
from tiered_ckpt.dist.coordination import decode_gathered
from tiered_ckpt.format.state import flatten
from tiered_ckpt.format.structure import Structure
from tiered_ckpt.io.gc_pause import cyclic_gc_paused


@pytest.fixture
def collector_enabled():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_a_pause_disables_the_collector_and_restores_it_after_an_error(collector_enabled):
    with pytest.raises(ValueError), cyclic_gc_paused():
        assert not gc.isenabled()
        raise ValueError("inside")
    assert gc.isenabled()


def test_a_collector_disabled_before_stays_disabled(collector_enabled):
    gc.disable()
    with cyclic_gc_paused():
        pass
    assert not gc.isenabled()


def test_overlapping_pauses_of_two_threads_enable_it_only_when_the_last_ends(collector_enabled):
    entered, leave = threading.Event(), threading.Event()

    def other() -> None:
        with cyclic_gc_paused():
            entered.set()
            leave.wait()

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    entered.wait()
    try:
        with cyclic_gc_paused():
            with cyclic_gc_paused():
                pass
            assert not gc.isenabled()
        assert not gc.isenabled()  # the other thread's pause is still open
    finally:
        leave.set()
        thread.join()
    assert gc.isenabled()


@pytest.fixture
def collections():
    counted: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            counted.append(info["generation"])

    gc.callbacks.append(count)
    yield counted
    gc.callbacks.remove(count)


def test_a_manifest_of_many_ranks_is_parsed_and_written_with_one_collection_at_most(collector_enabled, collections):
    text = json.dumps(valid_document(world_size=4096))
    collections.clear()
    manifest = ShardManifest.from_json(text)
    assert len(collections) <= 1  # the one the pause's end lets run; about 20 without it
    collections.clear()
    written = manifest.to_json()
    assert len(collections) <= 1
    assert len(manifest.shards) == 4096 and ShardManifest.from_json(written) == manifest


def test_payloads_of_many_ranks_are_decoded_with_one_collection_at_most(collector_enabled, collections):
    payloads = [json.dumps({"result": {"shards": [{"rank": rank, "sizes": [1, 2]}]}}).encode() for rank in range(4096)]
    collections.clear()
    decoded = decode_gathered(payloads)
    assert len(collections) <= 1  # the one the pause's end lets run
    assert decoded[4095] == {"result": {"shards": [{"rank": 4095, "sizes": [1, 2]}]}}


def test_a_state_of_many_arrays_is_flattened_and_its_structure_read_with_one_collection_each(
    collector_enabled, collections
):
    state = {"layers": [{"weight": np.zeros(2, np.float32), "bias": np.zeros(1, np.float32)} for _ in range(10_000)]}
    collections.clear()
    flat = flatten(state)
    assert len(collections) <= 1  # about 30 without the pause
    text = flat.structure.to_json()
    collections.clear()
    structure = Structure.from_json(text, flat.arrays, "shard")
    assert len(collections) <= 1
    collections.clear()
    built = structure.build(flat.arrays)
    assert len(collections) <= 1
    assert len(built["layers"]) == 10_000 and built["layers"][9_999]["bias"] is flat.arrays["layers/9999/bias"]
