"""What a rank holds for its partners (tiered_ckpt.tiers.peer.memory): slots reused, the budget kept,
what a crash left freed, and what it reads back never trusted."""

import hashlib

import numpy as np
import pytest

from tiered_ckpt import MemoryBudgetError, UsageError
from tiered_ckpt.tiers.peer.memory import PeerMemory, Slot


def take(
    memory: PeerMemory,
    step: int,
    rank: int,
    size: int,
    *,
    commit: bool = True,
    on_disk: bool = False,
    referenced: tuple[int, ...] = (),
) -> bytes:
    """Receive a shard of ``size`` bytes of ``step`` from ``rank`` as the peer tier does, referencing
    ``rank``'s files of the ``referenced`` steps (held already: pinned as a copy pins them); return its bytes."""
    data = np.random.default_rng(step * 31 + rank).integers(0, 256, size, dtype=np.uint8).tobytes()
    memory.pin(step, [(each, rank) for each in referenced])
    number, buffer = memory.buffer_for(step, rank, size)
    buffer[:] = np.frombuffer(data, np.uint8)
    memory.accept(number, Slot(step, rank, size, hashlib.sha256(data).hexdigest()))
    if commit:
        memory.commit(step, '{"a": "manifest"}', on_disk=on_disk, referenced=[(each, rank) for each in referenced])
    return data


def test_one_step_by_default_and_its_buffers_reused_so_the_memory_held_stays_flat(tmp_path):
    memory = PeerMemory(tmp_path)
    held = []
    for step in range(1, 101):
        data = take(memory, step, 3, 4096)
        held.append((memory.bytes_held(), len(list(tmp_path.iterdir()))))
        assert memory.steps() == [step]
        assert bytes(memory.view(step, 3)) == data
    # from the second step on: two slots (the step held, and room for the next one arriving),
    # one slot's record and the step's manifest, the same after every step
    assert held[0] == (4096, 3) and set(held[1:]) == {(8192, 4)}


def test_by_default_the_step_held_stays_until_the_next_one_is_committed(tmp_path):
    memory = PeerMemory(tmp_path)
    data = take(memory, 1, 0, 1000)
    number, buffer = memory.buffer_for(2, 0, 1000)  # step 2 arrives; its copy is not kept (yet)
    assert memory.steps() == [1] and bytes(memory.view(1, 0)) == data
    memory.release(number)
    assert memory.steps() == [1]  # a copy that failed takes nothing away


def test_the_slots_handed_out_for_several_wards_of_one_step_are_distinct(tmp_path):
    memory = PeerMemory(tmp_path)
    first, _ = memory.buffer_for(1, 0, 500)
    second, _ = memory.buffer_for(1, 1, 500)
    assert first != second


def test_a_budget_keeps_the_newest_steps_that_fit_and_the_newest_disk_step_last(tmp_path):
    memory = PeerMemory(tmp_path, max_bytes=3 * 1000)
    take(memory, 10, 0, 1000, on_disk=True)
    for step in (11, 12, 13, 14):  # kept in memory only
        take(memory, step, 0, 1000)
    assert memory.steps() == [10, 13, 14]  # the oldest memory-only steps went first
    assert memory.bytes_held() <= 3000


def test_a_shard_over_the_budget_is_refused_with_its_size_and_the_option(tmp_path):
    memory = PeerMemory(tmp_path, max_bytes=1000)
    take(memory, 1, 0, 800)
    with pytest.raises(MemoryBudgetError, match=r"1001 bytes, over the budget of 1000 bytes \(peer.max_bytes\)"):
        memory.buffer_for(2, 0, 1001)
    assert memory.steps() == [1]  # what is held stays


def test_a_step_whose_shards_cannot_fit_together_is_refused(tmp_path):
    memory = PeerMemory(tmp_path, max_bytes=1500)
    take(memory, 1, 0, 1000, commit=False)
    with pytest.raises(MemoryBudgetError, match="step 1's shards need more than the budget"):
        memory.buffer_for(1, 1, 1000)


def test_a_restarted_process_finds_what_was_committed_and_frees_what_a_crash_left(tmp_path):
    memory = PeerMemory(tmp_path, max_bytes=10_000)
    data = take(memory, 5, 2, 700)
    take(memory, 6, 2, 700, commit=False)  # the process died before the step's commit
    (tmp_path / ".slot-9.json.x.tmp").write_text("{")  # a write cut short
    again = PeerMemory(tmp_path, max_bytes=10_000)
    assert again.steps() == [5] and again.uncommitted_steps() == [6]
    assert bytes(again.view(5, 2)) == data
    assert not (tmp_path / ".slot-9.json.x.tmp").exists()


@pytest.mark.parametrize(
    "meta",
    [
        '{"step": 5, "rank": 2, "size": 700}',
        "not json",
        '{"step": -1, "rank": 2, "size": 700, "sha256": ""}',
        '{"step": 5, "rank": 2, "size": 99999, "sha256": ""}',
    ],  # fmt: skip
)
def test_a_slot_record_that_does_not_parse_frees_the_slot(tmp_path, meta, caplog):
    memory = PeerMemory(tmp_path)
    take(memory, 5, 2, 700)
    (tmp_path / "slot-0.json").write_text(meta)
    again = PeerMemory(tmp_path)
    assert again.steps() == [] and again.held(5) == {}
    assert "freeing slot 0" in caplog.text


def test_a_budget_that_is_not_a_positive_integer_is_refused(tmp_path):
    with pytest.raises(UsageError, match="max_bytes"):
        PeerMemory(tmp_path, max_bytes=0)


def test_by_default_the_newest_step_on_disk_stays_while_steps_kept_in_memory_only_come_and_go(tmp_path):
    memory = PeerMemory(tmp_path)
    on_disk = take(memory, 2, 0, 1000, on_disk=True)
    take(memory, 3, 0, 1000)  # in memory only: a lost node's ranks still need step 2's copy
    assert memory.steps() == [2, 3]
    take(memory, 5, 0, 1000)
    assert memory.steps() == [2, 5] and bytes(memory.view(2, 0)) == on_disk
    take(memory, 6, 0, 1000, on_disk=True)  # a newer step on disk: step 2's copy is needed no more
    assert memory.steps() == [6]


def test_by_default_a_slot_a_kept_step_references_stays_until_no_step_references_it(tmp_path):
    memory = PeerMemory(tmp_path)
    base = take(memory, 1, 0, 4000)  # a full step: the frozen base
    for step in range(2, 6):  # each writes its adapter only and references step 1's file
        take(memory, step, 0, 100, referenced=(1,))
        assert memory.steps() == [step] and memory.kept_steps() == [1]
        assert bytes(memory.view(1, 0)) == base
    # step 1's slot once, step 5's, and room for the next adapter: no second copy of the base
    assert memory.bytes_held() == 4000 + 2 * 100
    take(memory, 6, 0, 4000)  # a full step again: nothing references step 1 any more
    assert memory.steps() == [6] and memory.kept_steps() == [] and memory.held(1) == {}


def test_a_copy_in_flight_keeps_the_slots_it_found_held_whatever_makes_room_for_it(tmp_path):
    memory = PeerMemory(tmp_path, max_bytes=2500)
    base = take(memory, 1, 0, 1000)
    take(memory, 2, 0, 1000)
    # step 3's copy found step 1's file held: making its room deletes step 1 (the oldest) but
    # keeps its slot, and frees step 2's
    take(memory, 3, 0, 1000, referenced=(1,))
    assert memory.steps() == [3] and memory.kept_steps() == [1] and bytes(memory.view(1, 0)) == base


def test_within_a_budget_referencing_steps_go_oldest_first_and_their_kept_slots_with_the_last(tmp_path):
    memory = PeerMemory(tmp_path, max_bytes=3000)
    take(memory, 1, 0, 1000)
    take(memory, 2, 0, 1000, referenced=(1,))
    take(memory, 3, 0, 500, referenced=(1,))
    # room for step 4: deleting step 1 frees nothing (2, 3 and 4 reference its slot), step 2 does
    take(memory, 4, 0, 1000, referenced=(1,))
    assert memory.steps() == [3, 4] and memory.kept_steps() == [1] and memory.bytes_held() <= 3000
    take(memory, 5, 0, 1000)  # a full step: room from step 3; step 4 still references step 1
    assert memory.steps() == [4, 5] and memory.kept_steps() == [1]
    take(memory, 6, 0, 1000)  # room from step 4, the last step referencing step 1's slot
    assert memory.steps() == [5, 6] and memory.kept_steps() == [] and memory.bytes_held() <= 3000


def test_a_restarted_process_keeps_what_its_committed_steps_reference(tmp_path):
    memory = PeerMemory(tmp_path)
    base = take(memory, 1, 0, 4000)
    take(memory, 2, 0, 100, referenced=(1,))
    again = PeerMemory(tmp_path)
    assert again.steps() == [2] and again.kept_steps() == [1] and again.uncommitted_steps() == []
    assert bytes(again.view(1, 0)) == base
    again.delete_step(2)  # the last step referencing it: step 1's slot goes too
    assert again.steps() == [] and again.held(1) == {}


@pytest.mark.parametrize("refs", ["not json", '{"steps": [1], "ranks": []}', '{"steps": [true], "ranks": [0]}'])
def test_a_record_of_references_that_does_not_parse_uncommits_its_step(tmp_path, refs, caplog):
    memory = PeerMemory(tmp_path)
    take(memory, 1, 0, 4000)
    take(memory, 2, 0, 100, referenced=(1,))
    (tmp_path / "step-000000000002.refs").write_text(refs)
    again = PeerMemory(tmp_path)
    assert again.steps() == [] and "step 2 is no longer held" in caplog.text
    assert sorted(again.uncommitted_steps()) == [1, 2]  # left for the start-up's removal


def test_a_copy_that_cannot_fit_beside_the_files_it_found_held_is_refused_before_anything_goes(tmp_path):
    memory = PeerMemory(tmp_path, max_bytes=1000)
    take(memory, 1, 0, 600)
    take(memory, 2, 0, 300, referenced=(1,))
    memory.pin(3, [(1, 0)])  # step 3's copy references step 1's file: 600 + 500 bytes cannot fit
    with pytest.raises(MemoryBudgetError, match="500 bytes beside the 600 bytes of the earlier files"):
        memory.buffer_for(3, 0, 500)
    memory.unpin(3, [(1, 0)])
    assert memory.steps() == [1, 2] and memory.kept_steps() == []  # nothing deleted, nothing kept for step 3


def test_by_default_a_committed_step_no_longer_needed_goes_whole_before_the_next_copy(tmp_path):
    budgeted = PeerMemory(tmp_path, max_bytes=100_000)  # steps 2 and 3 committed, as a crash may leave them
    take(budgeted, 2, 0, 1000)
    take(budgeted, 2, 1, 1000)
    take(budgeted, 3, 0, 500, referenced=(2,))
    memory = PeerMemory(tmp_path)
    assert memory.steps() == [2, 3]
    number, _buffer = memory.buffer_for(4, 0, 500)
    # step 2 is deleted as a step: its slot step 3 references is kept, the other one freed with it
    assert memory.steps() == [3] and memory.kept_steps() == [2] and set(memory.held(2)) == {0}
    memory.release(number)
