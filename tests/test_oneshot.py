import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from support.processes import BYTES_PER_RANK, kill_child_at
from support.states import (
    ZERO1_SHARDED_KEYS,
    assert_states_equal,
    flip_byte,
    large_states,
    split_sizes,
    temp_files,
    zero1_states,
)
from tiered_ckpt import (
    CheckpointExistsError,
    ChecksumMismatchError,
    IncompleteCheckpointError,
    InvalidStateError,
    ManifestError,
    ShardCountMismatchError,
    WorldSizeMismatchError,
    load_sharded,
    save_sharded,
)
from tiered_ckpt.format.layout import MANIFEST_NAME, shard_name


@pytest.fixture
def saved(tmp_path, states):
    directory = tmp_path / "ckpt"
    manifest = save_sharded(states, directory, step=1234, sharded_keys=ZERO1_SHARDED_KEYS)
    return directory, manifest


def test_zero1_state_over_four_ranks_round_trips_byte_for_byte(saved, states):
    directory, manifest = saved
    assert_states_equal(states, load_sharded(directory, expected_world_size=4))
    assert sorted(os.listdir(directory)) == sorted([MANIFEST_NAME] + [shard_name(r, 4) for r in range(4)])


def test_manifest_records_the_lessons_fields_and_the_flat_parameter_slices(saved):
    directory, manifest = saved
    on_disk = json.loads((directory / MANIFEST_NAME).read_text())
    assert on_disk["world_size"] == 4 and on_disk["step"] == 1234 and on_disk["schema_version"] == 2
    assert isinstance(on_disk["wall_clock_seconds"], float)
    sizes = split_sizes(1003, 4)
    assert [s["param_shard_numel"] for s in on_disk["shards"]] == sizes
    assert [s["param_shard_offset"] for s in on_disk["shards"]] == [sum(sizes[:r]) for r in range(4)]
    assert [s["rank"] for s in on_disk["shards"]] == [0, 1, 2, 3]
    for record in on_disk["shards"]:
        assert (directory / record["path"]).stat().st_size == record["size_bytes"]
    assert on_disk["sharded_keys"] == sorted(ZERO1_SHARDED_KEYS)


def test_default_sharded_keys_are_the_arrays_one_dimensional_on_every_rank(tmp_path, states):
    for state in states:
        del state["empty"]
    manifest = save_sharded(states, tmp_path, step=1)
    assert manifest.sharded_keys == ("exp_avg", "exp_avg_sq", "master_fp32", "param_fp16")
    assert [r.param_shard_numel for r in manifest.shards] == split_sizes(1003, 4)


def test_ambiguous_sharded_keys_are_refused_naming_the_rank(tmp_path, states):
    with pytest.raises(InvalidStateError, match="rank 0: sharded arrays must have one length"):
        save_sharded(states, tmp_path, step=1)  # "empty" is 1-D with length 0
    with pytest.raises(InvalidStateError, match="rank 0: sharded key 'step' has shape"):
        save_sharded(states, tmp_path, step=1, sharded_keys=["step"])
    assert not (tmp_path / MANIFEST_NAME).exists()


def test_one_thread_gives_the_same_files(tmp_path, states):
    a = save_sharded(states, tmp_path / "a", step=1, sharded_keys=ZERO1_SHARDED_KEYS, max_workers=1)
    b = save_sharded(states, tmp_path / "b", step=1, sharded_keys=ZERO1_SHARDED_KEYS, max_workers=4)
    assert [r.sha256 for r in a.shards] == [r.sha256 for r in b.shards]


# --- the lesson's three failure modes -------------------------------------------------


@pytest.mark.parametrize("expected", [2, 8])
def test_changed_world_size_fails_loudly(saved, expected):
    directory, _ = saved
    with pytest.raises(WorldSizeMismatchError, match=f"saved by 4 ranks, but {expected} are loading") as caught:
        load_sharded(directory, expected_world_size=expected)
    assert str(directory) in str(caught.value)


def test_shard_count_mismatch_fails_loudly(saved):
    directory, _ = saved
    document = json.loads((directory / MANIFEST_NAME).read_text())
    del document["shards"][3]
    (directory / MANIFEST_NAME).write_text(json.dumps(document))
    with pytest.raises(ShardCountMismatchError, match="lists 3 shards but world_size is 4") as caught:
        load_sharded(directory, expected_world_size=4)
    assert str(directory / MANIFEST_NAME) in str(caught.value)


def test_partial_write_without_manifest_fails_loudly(saved):
    directory, _ = saved
    (directory / MANIFEST_NAME).unlink()
    with pytest.raises(IncompleteCheckpointError, match="never committed"):
        load_sharded(directory, expected_world_size=4)


# --- damaged shards on disk --------------------------------------------------------------


@pytest.mark.parametrize("rank", [0, 3])
@pytest.mark.parametrize("verify", ["full", "fast"])
def test_flipped_byte_names_rank_and_file(saved, rank, verify):
    directory, manifest = saved
    path = directory / manifest.shard(rank).path
    flip_byte(path, path.stat().st_size // 2)
    with pytest.raises(ChecksumMismatchError, match=f"rank {rank} shard {path}"):
        load_sharded(directory, 4, verify=verify)


def test_flipped_byte_in_a_shard_header_is_a_checksum_mismatch(saved):
    directory, manifest = saved
    path = directory / manifest.shard(1).path
    flip_byte(path, 20)
    with pytest.raises(ChecksumMismatchError, match="rank 1"):
        load_sharded(directory, 4)


def test_truncated_shard_is_incomplete(saved):
    directory, manifest = saved
    path = directory / manifest.shard(2).path
    os.truncate(path, manifest.shard(2).size_bytes // 2)
    with pytest.raises(IncompleteCheckpointError, match=f"rank 2 shard {path}: file is short"):
        load_sharded(directory, 4)


def test_deleted_shard_is_incomplete(saved):
    directory, manifest = saved
    (directory / manifest.shard(1).path).unlink()
    with pytest.raises(IncompleteCheckpointError, match="rank 1 shard .* file is missing"):
        load_sharded(directory, 4)


def test_manifest_pointing_outside_the_checkpoint_is_refused(saved, tmp_path):
    directory, _ = saved
    (tmp_path / "secret").write_bytes(b"x")
    document = json.loads((directory / MANIFEST_NAME).read_text())
    document["shards"][0]["path"] = "../secret"
    (directory / MANIFEST_NAME).write_text(json.dumps(document))
    with pytest.raises(ManifestError, match="shards\\[rank 0\\].path"):
        load_sharded(directory, 4)


# --- saving over an existing checkpoint and bad input ------------------------------------


def test_saving_into_a_committed_checkpoint_is_refused_and_leaves_it_loadable(saved, states):
    directory, _ = saved
    other = zero1_states(seed=99)
    with pytest.raises(CheckpointExistsError, match=str(directory)):
        save_sharded(other, directory, step=1235, sharded_keys=ZERO1_SHARDED_KEYS)
    assert_states_equal(states, load_sharded(directory, 4))


def test_bad_state_on_one_rank_commits_nothing_and_leaves_no_temp_files(tmp_path, states):
    states[2]["bad"] = np.ones(3, "datetime64[s]")
    with pytest.raises(InvalidStateError, match=r'state\["bad"\] has dtype datetime64\[s\]'):
        save_sharded(states, tmp_path, step=1, sharded_keys=ZERO1_SHARDED_KEYS)
    assert not (tmp_path / MANIFEST_NAME).exists()
    assert temp_files(tmp_path) == []


@pytest.mark.parametrize(
    "call, problem",
    [
        (lambda s, d: save_sharded(s, d, step=1, world_size=3), "world_size is 3 but 4 rank states"),
        (lambda s, d: save_sharded(s, d, step=-1), "step must be an integer from 0"),
        (lambda s, d: save_sharded([], d, step=1), "empty"),
        (lambda s, d: save_sharded(s[0], d, step=1), "one dict of arrays per rank"),
        (lambda s, d: save_sharded([*s[:3], [1]], d, step=1), "rank 3: state is a list"),
    ],
)
def test_invalid_arguments_are_refused(tmp_path, states, call, problem):
    with pytest.raises(InvalidStateError, match=problem):
        call(states, tmp_path)


# --- a real crash: SIGKILL of a process in the middle of a save --------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "point, leaves_temp_files",
    [
        (f"shard-bytes:{BYTES_PER_RANK + BYTES_PER_RANK // 2}", True),
        ("before-manifest", False),
        ("manifest-rename", True),
    ],
)
def test_sigkill_during_save_keeps_previous_checkpoint_and_commits_nothing(tmp_path, states, point, leaves_temp_files):
    previous = tmp_path / "step-000000000001"
    save_sharded(states, previous, step=1, sharded_keys=ZERO1_SHARDED_KEYS)
    killed = tmp_path / "step-000000000002"

    kill_child_at(killed, point)

    assert_states_equal(states, load_sharded(previous, 4))
    with pytest.raises(IncompleteCheckpointError):
        load_sharded(killed, 4)
    assert bool(temp_files(killed)) == leaves_temp_files
    fresh = large_states(4, BYTES_PER_RANK)
    save_sharded(fresh, killed, step=2)
    assert temp_files(killed) == []
    assert_states_equal(fresh, load_sharded(killed, 4))


@pytest.mark.slow
def test_sigkill_right_after_the_manifest_rename_leaves_a_complete_checkpoint(tmp_path):
    killed = tmp_path / "step-000000000002"
    kill_child_at(killed, "after-commit")
    assert_states_equal(large_states(4, BYTES_PER_RANK), load_sharded(killed, 4))


# --- loading into the caller's own arrays ------------------------------------------------


def test_load_into_preallocated_arrays_fills_them_in_place(saved, states):
    directory, _ = saved
    buffers = [{key: np.zeros_like(array) for key, array in state.items()} for state in states]
    identities = [{key: id(array) for key, array in state.items()} for state in buffers]
    loaded = load_sharded(directory, 4, into=buffers)
    assert_states_equal(states, buffers)
    assert [{key: id(array) for key, array in state.items()} for state in loaded] == identities


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda b: b[1].pop("exp_avg"), "into does not match the shard: 1 missing from into: 'exp_avg'$"),
        (lambda b: b[1].update(exp_avg=np.zeros(3, np.float32)), r"'exp_avg' float32 3 \(the shard: float32 25\d\)"),
        (lambda b: b[1].update(step=np.zeros((), np.int32)), r"'step' int32 scalar \(the shard: int64 scalar\)"),
        (
            lambda b: b[1].update(
                embedding_bf16=np.zeros((16, 8), np.float32).T.astype(b[1]["embedding_bf16"].dtype, order="K")
            ),
            "C-contiguous",
        ),
    ],
)
def test_load_into_mismatched_arrays_is_refused_before_copying(saved, states, change, problem):
    directory, _ = saved
    buffers = [{key: np.zeros_like(array) for key, array in state.items()} for state in states]
    change(buffers)
    with pytest.raises(InvalidStateError, match=problem):
        load_sharded(directory, 4, into=buffers, max_workers=1)
    assert all(not array.any() for array in buffers[1].values())


def test_load_into_needs_one_dict_per_rank(saved, states):
    directory, _ = saved
    with pytest.raises(InvalidStateError, match="into holds 3 rank states"):
        load_sharded(directory, 4, into=states[:3])


# --- a real full disk: the file size limit (RLIMIT_FSIZE) makes a later rank's write fail (EFBIG) ---

FULL_DISK_SAVE = """
import errno, resource, sys
import numpy as np
from tiered_ckpt import save_sharded
sizes = [int(n) for n in sys.argv[2].split(",")]
states = [{"w": np.full(n, rank, np.float32), "table": np.arange(6).reshape(2, 3)} for rank, n in enumerate(sizes)]
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), int(sys.argv[3])))
try:
    save_sharded(states, sys.argv[1], step=2, max_workers=1)  # one thread: the ranks in order
except OSError as error:
    print("raised", errno.errorcode[error.errno])
    sys.exit(0)
print("no error")
"""


def save_on_a_full_disk(directory: Path, sizes: list[int], limit: int) -> None:
    """Save ranks of ``sizes`` float32s into ``directory`` in a process whose files cannot pass ``limit`` bytes."""
    run = subprocess.run(
        [sys.executable, "-c", FULL_DISK_SAVE, str(directory), ",".join(map(str, sizes)), str(limit)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.stdout.strip() == "raised EFBIG", run.stderr


@pytest.mark.parametrize("made", [True, False], ids=["new-directory", "existing-directory"])
def test_a_save_failing_on_a_full_disk_removes_every_file_it_wrote_and_keeps_the_previous_step(tmp_path, made):
    previous = tmp_path / "step-1"
    states = [{"w": np.full(1000, rank, np.float32)} for rank in range(3)]
    save_sharded(states, previous, step=1)
    failing = tmp_path / "step-2"
    if not made:
        failing.mkdir()
        (failing / "notes.txt").write_text("the user's own file")
    # ranks 0 and 1 (256 KiB each) fit under 2 MiB and are renamed into place; rank 2's 8 MiB do not
    save_on_a_full_disk(failing, [64 << 10, 64 << 10, 2 << 20], 2 << 20)
    if made:
        assert not failing.exists()
    else:
        assert sorted(path.name for path in failing.iterdir()) == ["notes.txt"]
    assert_states_equal(states, load_sharded(previous, 3))
    fresh = [{"w": np.full(10, rank, np.float32)} for rank in range(3)]
    save_sharded(fresh, failing, step=2)  # and the step can be saved again
    assert_states_equal(fresh, load_sharded(failing, 3))


def test_a_save_whose_manifest_does_not_fit_removes_every_rank_file(tmp_path):
    failing = tmp_path / "step-2"
    save_on_a_full_disk(failing, [4] * 16, 5000)  # 16 shards of ~300 bytes fit; a manifest of ~6 KB does not
    assert not failing.exists()
