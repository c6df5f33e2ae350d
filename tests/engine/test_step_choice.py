"""Which step a restore reads (tiered_ckpt.engine.step_choice): the reports, what each disk holds, the choice."""

import logging

import numpy as np
import pytest

from tiered_ckpt import CheckpointManager, IncompleteCheckpointError, InvalidStateError, RemoteOptions, UsageError
from tiered_ckpt.dist.coordination import Attempt, SingleProcessCoordinator
from tiered_ckpt.engine.step_choice import StepChooser, same_call
from tiered_ckpt.engine.step_decision import Disks, Holdings, StepReport
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.remote.tier import RemoteTier
from tiered_ckpt.tiers.store import TieredStore

CHECKED = Attempt.run(lambda: None)


def reports() -> list[StepReport]:
    """Three ranks' disks: step 1 on all, step 2 on ranks 0 and 2 (rank 2's manifest damaged), step 3 on rank 1."""
    return [
        StepReport("{}", (("local", ((1, 3, None), (2, 3, None))),), ((1, True), (2, False))),
        StepReport("{}", (("local", ((1, 3, None), (3, 2, None))),), ((1, True), (3, None))),
        StepReport("{}", (("local", ((1, 3, None), (2, None, None))),), ((1, True),)),
    ]


def test_disks_say_which_rank_holds_which_step():
    disks = Disks.of(reports())
    assert disks.steps() == {1, 2, 3}
    assert disks.on_every_disk() == {1}
    assert disks.holders(2) == [0, 2] and disks.lacking(2) == [1]
    assert disks.world_sizes[2] == {1: 3, 2: None}
    assert disks.agreed[0] == {1: True, 2: False} and disks.agreed[2].get(2) is None
    left = disks.without([2, 3])
    assert left.steps() == {1} and left.agreed == disks.agreed
    assert disks.steps() == {1, 2, 3}  # frozen: without() makes new disks


def test_same_call_names_each_ranks_arguments_when_they_differ():
    same_call(['{"step": 1}', '{"step": 1}'], "restore")
    with pytest.raises(InvalidStateError) as refused:
        same_call(['{"step": 1}', '{"step": 2}'], "save")
    assert str(refused.value) == "the ranks called save with different arguments: {0: {'step': 1}, 1: {'step': 2}}"


@pytest.fixture
def saved(tmp_path):
    """Steps 1 and 2 of 2 ranks in ``tmp_path``, and a chooser over its local tier (held under its lock)."""
    with CheckpointManager(tmp_path, world_size=2) as manager:
        for step in (1, 2):
            manager.save(step, [{"w": np.full(4, rank, np.float32)} for rank in range(2)], blocking=True)
    tier = LocalTier(tmp_path)
    with tier.lock():
        yield StepChooser(TieredStore([tier]), SingleProcessCoordinator(2), 2)


def test_the_chooser_agrees_on_the_newest_step_or_the_one_asked_for(saved):
    agreed = saved.agree(None, "{}", 2, False, CHECKED)
    assert agreed.choice.step == 2 and agreed.choice.unfinished == ()
    assert agreed.complete == (1, 2) and agreed.remote_steps == frozenset()
    (report,) = agreed.reports
    assert report.tiers == (("local", ((1, 2, None), (2, 2, None))),) and report.down == ()
    assert report.agreed == ((1, True), (2, True))
    assert saved.agree(1, "{}", 2, False, CHECKED).choice.step == 1


def test_a_step_not_committed_is_refused_naming_the_committed_ones(saved):
    with pytest.raises(IncompleteCheckpointError, match=r": step 5 is not committed; committed steps: \[1, 2\]$"):
        saved.agree(5, "{}", 2, False, CHECKED)


def test_nothing_anywhere_is_no_step_only_when_missing_is_ok(tmp_path):
    tier = LocalTier(tmp_path)
    with tier.lock():
        chooser = StepChooser(TieredStore([tier]), SingleProcessCoordinator(1), 1)
        assert chooser.agree(None, "{}", 1, True, CHECKED).choice.step is None
        with pytest.raises(IncompleteCheckpointError, match=": no committed checkpoint to restore$"):
            chooser.agree(None, "{}", 1, False, CHECKED)


def test_the_callers_failed_check_is_raised_inside_the_first_collective(saved):
    with pytest.raises(UsageError, match="^refused$"):
        saved.agree(None, "{}", 2, False, Attempt(error=UsageError("refused")))


@pytest.mark.parametrize("fails", [False, True])
def test_the_record_the_leaders_listing_read_serves_only_its_own_choice(tmp_path, memory_url, monkeypatch, fails):
    url, options = memory_url
    with CheckpointManager(tmp_path, world_size=2, remote=RemoteOptions(url, storage_options=options)) as manager:
        manager.save(1, [{"w": np.full(4, rank, np.float32)} for rank in range(2)], blocking=True)
        manager.wait(uploaded=True)
    bucket = RemoteTier(url, options)
    read, kept = bucket.take_expected, []
    monkeypatch.setattr(bucket, "take_expected", lambda step: (kept.append(bucket._expected), read(step))[1])
    if fails:  # the choice fails once the leader's listing read step 1's record
        monkeypatch.setattr(Holdings, "choose", lambda *args: (_ for _ in ()).throw(UsageError("no choice")))
    tier = LocalTier(tmp_path)
    with tier.lock():
        chooser = StepChooser(TieredStore([tier, bucket]), SingleProcessCoordinator(2), 2)
        if fails:
            with pytest.raises(UsageError, match="no choice"):
                chooser.agree(None, "{}", 2, False, CHECKED)
        else:
            assert chooser.agree(None, "{}", 2, False, CHECKED).choice.bucket_shards is not None
    assert kept[0] is not None and kept[0].manifest.step == 1  # read beside the listing
    assert bucket._expected is None  # and let go, whatever the choice did


def test_dropping_deletes_nothing_every_rank_committed(saved, caplog):
    agreed = saved.agree(1, "{}", 2, False, CHECKED)
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        saved.drop_unfinished_saves(agreed)
        saved.drop_unfinished_commits(1, agreed)
    assert caplog.records == []
    assert saved.agree(None, "{}", 2, False, CHECKED).choice.step == 2
