"""Incremental saves as a stateful property (hypothesis): random sequences of saves that change
some arrays, retention of every kind, prunes, restarts, SIGKILLed saves and retention passes (a
real child process killed at a chosen point) and restores, over more than 1,000 saves in all,
on a disk alone and on a disk with a bucket (its uploads, retention and commits killed too,
and the disk lost, the bucket restoring it). After every rule, each retained step restores
bit for bit and every file a committed step references is there, on the disk and in the
bucket; after a start, no file is left that nothing references."""

import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from support.processes import kill_when_told
from support.states import INCREMENTAL_ARRAYS, incremental_state, referenced_files_exist, same_state
from tiered_ckpt import CheckpointManager, LocalOptions, RemoteOptions
from tiered_ckpt.format.layout import KEPT_NAME
from tiered_ckpt.tiers.remote.compression import object_name
from tiered_ckpt.tiers.remote.tier import RemoteTier

CHILD = Path(__file__).resolve().parent.parent / "support" / "incremental_child.py"
POINTS = ("before-commit", "kept-marked", "removing", "removing-dir")
REMOTE_POINTS = (*POINTS, "remote-commit", "remote-kept", "remote-removing")
SAVES = [0]  # every save the machine made, over every example


class IncrementalSaves(RuleBasedStateMachine):
    """A job's directory under random saves, retention, restarts and kills."""

    @initialize(keep_last=st.sampled_from([1, 2, 3, None]))
    def start(self, keep_last):
        self.root = Path(tempfile.mkdtemp(prefix="incremental-machine-"))
        self.keep_last = keep_last
        self.versions = [0] * INCREMENTAL_ARRAYS
        self.saved: dict[int, list[int]] = {}  # every step a save committed, with its arrays' versions
        self.step = 0
        self.kills = 0
        self.manager = self._open()

    def _open(self) -> CheckpointManager:
        return CheckpointManager(LocalOptions(self.root, keep_last=self.keep_last), world_size=1)

    def _change(self, changed) -> None:
        for index in changed:
            self.versions[index] = self.step

    @rule(changes=st.lists(st.sets(st.integers(0, INCREMENTAL_ARRAYS - 1)), min_size=1, max_size=6))
    def save(self, changes):
        for changed in changes:
            self.step += 1
            self._change(changed)
            self.manager.save(self.step, incremental_state(self.step, dict(enumerate(self.versions))), blocking=True)
            self.saved[self.step] = list(self.versions)
            SAVES[0] += 1

    @rule(keep_last=st.sampled_from([1, 2, 3, None]))
    def restart(self, keep_last):
        self.manager.close()
        self.keep_last = keep_last
        self.manager = self._open()
        self.manager.prune(dry_run=False)

    @rule()
    def prune(self):
        self.manager.wait()
        self.manager.prune(dry_run=False)

    points = POINTS

    def _child_arguments(self) -> list[str]:
        return []

    @precondition(lambda self: self.kills < 1)
    @rule(data=st.data(), changed=st.sets(st.integers(0, INCREMENTAL_ARRAYS - 1)))
    def sigkill(self, data, changed):
        """A real process saves the next step and is SIGKILLed at a point (of its save or of the
        retention that follows), or once it is done if it never gets there."""
        point = data.draw(st.sampled_from(self.points))
        self.manager.close()
        self.kills += 1
        self.step += 1
        self._change(changed)
        keep = "none" if self.keep_last is None else str(self.keep_last)
        command = [
            sys.executable,
            str(CHILD),
            str(self.root),
            point,
            "1",
            str(self.step),
            json.dumps(self.versions),
            keep,
            *self._child_arguments(),
        ]
        kill_when_told(command, point, ("PAUSED\n", "DONE\n"))
        SAVES[0] += 1
        self.manager = self._open()
        if self.step in self.manager.steps():
            self.saved[self.step] = list(self.versions)
        self._no_file_unreferenced()  # the start removed what the kill left

    @precondition(lambda self: self.saved)
    @rule(data=st.data())
    def restore(self, data):
        steps = self.manager.steps()  # which depends on when uploads end: the draw must not
        pick = data.draw(st.integers(0, 1 << 16))
        if steps:
            step = steps[pick % len(steps)]
            state = self.manager.restore(step=step).states[0]
            assert same_state(state, incremental_state(step, dict(enumerate(self.saved[step]))))

    @invariant()
    def every_retained_step_restores_and_its_references_resolve(self):
        if not hasattr(self, "manager"):
            return
        self.manager.wait()
        assert referenced_files_exist(self.root) == []
        steps = self.manager.steps()
        assert set(steps) <= set(self.saved)
        if steps:  # the newest, every time (each restore rule draws another)
            state = self.manager.restore(step=steps[-1]).states[0]
            assert same_state(state, incremental_state(steps[-1], dict(enumerate(self.saved[steps[-1]]))))

    def _no_file_unreferenced(self) -> None:
        referenced = {
            (ref["step"], ref["file"]["path"])
            for manifest in self.root.glob("step-*/manifest.json")
            for shard in json.loads(manifest.read_text())["shards"]
            for ref in shard.get("references", ())
        }
        for path in self.root.glob("kept-step-*/rank-*"):
            assert (int(path.parent.name.rpartition("-")[2]), path.name) in referenced, path

    def teardown(self):
        if hasattr(self, "manager"):
            self.manager.close()
            shutil.rmtree(self.root, ignore_errors=True)


class IncrementalSavesWithABucket(IncrementalSaves):
    """The same with a bucket (``file://``: real processes share it), its own retention and
    cadence, whose uploads, commits and retention a kill may cut too, and a rule losing the disk."""

    points = REMOTE_POINTS

    @initialize(
        keep_last=st.sampled_from([1, 2, None]),
        remote_keep=st.sampled_from([1, 2, None]),
        every=st.sampled_from([1, 2]),
    )
    def start(self, keep_last, remote_keep, every):
        self.bucket = Path(tempfile.mkdtemp(prefix="incremental-bucket-"))
        self.remote_keep, self.every = remote_keep, every
        self.url = f"file://{self.bucket}"
        super().start(keep_last)

    def _open(self) -> CheckpointManager:
        remote = RemoteOptions(self.url, keep_last=self.remote_keep, every=self.every)
        return CheckpointManager(LocalOptions(self.root, keep_last=self.keep_last), remote=remote, world_size=1)

    def _child_arguments(self) -> list[str]:
        return [self.url, "none" if self.remote_keep is None else str(self.remote_keep), str(self.every)]

    @precondition(lambda self: self.saved)
    @rule()
    def lose_the_disk(self):
        """The disk is lost: the newest step the bucket holds restores from it alone, bit for bit."""
        self.manager.wait(uploaded=True)
        self.manager.close()
        shutil.rmtree(self.root, ignore_errors=True)
        self.manager = self._open()
        steps = RemoteTier(self.url).steps()
        if steps:
            state = self.manager.restore(step=steps[-1]).states[0]
            assert same_state(state, incremental_state(steps[-1], dict(enumerate(self.saved[steps[-1]]))))

    @invariant()
    def the_bucket_holds_what_its_steps_reference(self):
        if not hasattr(self, "manager"):
            return
        self.manager.wait(uploaded=True)
        tier = RemoteTier(self.url)
        committed, _uncommitted, kept = tier.survey()
        assert set(committed) <= set(self.saved)
        referenced = set()
        for step in committed:
            remote = tier.read_manifest(step)
            for ref in (ref for record in remote.manifest.shards for ref in record.references):
                stored = remote.stored(ref.step, ref.file.path)
                path = Path(tier._path(ref.step, object_name(stored.location, stored.compression)))
                assert path.is_file() and path.stat().st_size == ref.file.size_bytes, path
                referenced.add(path)
        self.referenced_in_bucket = referenced

    def _no_file_unreferenced(self) -> None:
        super()._no_file_unreferenced()
        self.the_bucket_holds_what_its_steps_reference()
        tier = RemoteTier(self.url)
        for step in tier.kept_steps():
            for name in tier.backend.find(tier._path(step)):
                assert name.endswith(KEPT_NAME) or Path(name) in self.referenced_in_bucket, name

    def teardown(self):
        super().teardown()
        shutil.rmtree(getattr(self, "bucket", "/nonexistent"), ignore_errors=True)


def _long_run(machine: type[IncrementalSaves], steps: int, saves: int) -> None:
    """Run ``machine`` over 35 derandomized examples of ``steps`` rules; at least ``saves`` saves."""
    SAVES[0] = 0
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=35,
            stateful_step_count=steps,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    assert SAVES[0] >= saves, f"only {SAVES[0]} saves were made"


@pytest.mark.slow
def test_every_retained_step_restores_under_random_saves_retention_and_kills():
    _long_run(IncrementalSaves, steps=80, saves=1000)


@pytest.mark.slow
def test_every_retained_step_restores_from_the_disk_or_the_bucket_under_random_saves_and_kills():
    _long_run(IncrementalSavesWithABucket, steps=60, saves=400)


def test_a_short_run_of_the_machine():
    SAVES[0] = 0
    run_state_machine_as_test(
        IncrementalSaves, settings=settings(max_examples=6, stateful_step_count=10, deadline=None, derandomize=True)
    )
    assert SAVES[0] > 0


def test_a_short_run_of_the_machine_with_a_bucket():
    SAVES[0] = 0
    run_state_machine_as_test(
        IncrementalSavesWithABucket,
        settings=settings(max_examples=4, stateful_step_count=10, deadline=None, derandomize=True),
    )
    assert SAVES[0] > 0
