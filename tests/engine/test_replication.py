"""The replication engine on its own: the upload queue against an in-memory bucket whose backend fails
on command, and a third tier (a partner's memory) as one more target."""

import logging
import threading
from collections import deque
from pathlib import PurePosixPath

import numpy as np
import pytest

from support.memory_tier import MemoryTier
from tiered_ckpt import RemoteError, UploadError, UsageError, save_sharded
from tiered_ckpt.build import replication_policy
from tiered_ckpt.engine.background import ErrorBox
from tiered_ckpt.engine.replication import Backlog, ReplicationPolicy, Replicator
from tiered_ckpt.format.layout import parse_step_dir_name, step_dir_name
from tiered_ckpt.options import UploadOptions
from tiered_ckpt.tiers.base import ShardSource
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.remote.backends.wrappers import Wrapper
from tiered_ckpt.tiers.remote.tier import RemoteTier, RetryPolicy
from tiered_ckpt.tiers.retention import RetentionPolicy
from tiered_ckpt.tiers.store import TieredStore


class Failing(Wrapper):
    """A backend whose shard PUTs raise the queued exceptions first, and can be held."""

    def __init__(self, inner):
        super().__init__(inner)
        self.failures: deque[BaseException] = deque()
        self.puts: list[int] = []
        self.hold = threading.Event()
        self.hold.set()
        self.holding = threading.Event()
        self.down = False  # while True, every PUT fails with a transient error
        self.failed = threading.Event()  # set by each failed PUT

    def put_shard(self, local_path, path, record, *, deadline):
        self.puts.append(parse_step_dir_name(PurePosixPath(path).parent.name))
        self.holding.set()
        self.hold.wait()
        if self.failures or self.down:
            self.failed.set()
            raise self.failures.popleft() if self.failures else transient()
        return super().put_shard(local_path, path, record, deadline=deadline)


def transient() -> OSError:
    return ConnectionResetError("reset by peer")


@pytest.fixture
def job(tmp_path, memory_url):
    """A local tier with steps 1..4 committed (1 rank each) and an uploader over a failing remote."""
    for step in range(1, 5):
        save_sharded([{"w": np.full(64, step, np.float32)}], tmp_path / "ckpt" / step_dir_name(step), step=step)
    remote = RemoteTier(memory_url[0], retry=RetryPolicy(max_tries=3, backoff_seconds=0), wrap=Failing)
    faults = remote.backend.inner
    store = TieredStore([LocalTier(tmp_path / "ckpt"), remote])
    uploaders = []

    def start(**options):
        uploader = Replicator(store, policy=replication_policy(UploadOptions(**options)), errors=ErrorBox())
        uploaders.append(uploader)
        return uploader

    with store.local.lock():
        yield store, remote, faults, start
        for uploader in uploaders:
            uploader.close()


def test_transient_failures_within_the_tries_still_commit(job):
    store, remote, faults, start = job
    faults.failures.extend([transient(), transient()])
    uploader = start()
    uploader.submit(1)
    uploader.wait()
    uploader.errors.raise_first()  # nothing failed
    assert remote.steps() == [1] and store.receipted(1)
    assert faults.puts == [1, 1, 1]  # two failed tries, then the one that went through


def test_a_transient_failure_that_outlasts_max_tries_is_tried_again_until_the_step_commits(job, caplog):
    store, remote, faults, start = job
    faults.failures.extend([transient() for _ in range(10)])  # 3 whole tries of 3 requests, then 1 more
    uploader = start()
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        uploader.submit(1)
        uploader.wait()
    uploader.errors.raise_first()  # nothing failed: a transient failure is no error
    assert remote.steps() == [1] and store.receipted(1)
    assert faults.puts == [1] * 11  # one retry loop per try of the step: tries never multiply
    retried = [r.getMessage() for r in caplog.records if r.getMessage().startswith("upload of step 1 failed")]
    assert len(retried) == 3 and all("reset by peer" in message for message in retried)
    assert "try 3, 9 requests tried" in retried[-1]
    assert uploader.retrying() is None


def test_a_step_that_misses_its_deadline_while_the_bucket_fails_stays_local_and_the_next_goes_on(job):
    store, remote, faults, start = job
    faults.down = True
    uploader = start(deadline_seconds=0.3)
    uploader.submit(1)
    uploader.wait()
    with pytest.raises(UploadError, match="step 1 was not committed .* within its deadline of 0.3 s") as caught:
        uploader.errors.raise_first()
    assert caught.value.transient and caught.value.step == 1 and caught.value.tries > 3
    assert "it stays local-only" in str(caught.value) and isinstance(caught.value.__cause__, RemoteError)
    assert remote.steps() == [] and not store.receipted(1) and 1 in store.local.steps()
    faults.down = False  # the bucket is back
    uploader.submit(2)
    uploader.wait()
    uploader.errors.raise_first()
    assert remote.steps() == [2]


def test_while_the_bucket_fails_the_queue_takes_steps_without_blocking_up_to_max_awaiting_upload(job, tmp_path):
    store, remote, faults, start = job
    for step in range(5, 9):
        save_sharded([{"w": np.full(64, step, np.float32)}], tmp_path / "ckpt" / step_dir_name(step), step=step)
    faults.down = True
    store.retention = {"local": RetentionPolicy(keep_last=1, max_awaiting_upload=3)}
    policy = ReplicationPolicy(max_pending=1, when_behind="wait", deadline_seconds=None)
    uploader = Replicator(store, policy=policy, errors=ErrorBox())
    try:
        uploader.submit(1)
        while uploader.retrying() is None:  # wait for the first failed try (guarded by the test timeout)
            faults.failed.wait()
        for step in range(2, 9):  # with a healthy bucket the second submit would block (max_pending=1)
            uploader.submit(step)
        assert uploader.pending() == [1, 6, 7, 8]  # the oldest queued dropped beyond 3 waiting steps
        assert uploader.retrying()[0] == 1
        faults.down = False
        uploader.wait()
        uploader.errors.raise_first()
        assert remote.steps() == [1, 6, 7, 8]
    finally:
        uploader.close()


def test_a_permanent_failure_is_not_retried(job):
    _store, remote, faults, start = job
    faults.failures.append(PermissionError("AccessDenied"))
    uploader = start()
    uploader.submit(1)
    uploader.wait()
    with pytest.raises(UploadError) as caught:
        uploader.errors.raise_first()
    assert caught.value.tries == 1 and faults.puts == [1]


def test_steps_are_uploaded_in_order_and_skip_drops_the_oldest_waiting(job):
    _store, remote, faults, start = job
    faults.hold.clear()
    uploader = start(max_pending=1, when_behind="skip")
    uploader.submit(1)
    faults.holding.wait()  # step 1 is being put, out of the queue
    uploader.submit(2)
    uploader.submit(3)  # the queue is full: 2 is dropped
    assert uploader.pending() == [1, 3]
    faults.hold.set()
    uploader.wait()
    assert remote.steps() == [1, 3]


def test_wait_mode_never_blocks_the_submitter_and_uploads_every_waiting_step_in_order(job, tmp_path):
    store, remote, faults, start = job
    for step in range(5, 8):
        save_sharded([{"w": np.full(64, step, np.float32)}], tmp_path / "ckpt" / step_dir_name(step), step=step)
    store.retention = {"local": RetentionPolicy(keep_last=1, max_awaiting_upload=3)}
    faults.hold.clear()  # a bucket that takes the first PUT and gives no answer (yet)
    uploader = start(max_pending=1, when_behind="wait")
    try:
        uploader.submit(1)
        faults.holding.wait()
        for step in range(2, 5):  # beyond max_pending, up to max_awaiting_upload: none waits, none is dropped
            uploader.submit(step)
        assert uploader.pending() == [1, 2, 3, 4]
        for step in range(5, 8):  # beyond max_awaiting_upload: the oldest waiting steps give way
            uploader.submit(step)
        assert uploader.pending() == [1, 5, 6, 7]
        faults.hold.set()
        uploader.wait()
        uploader.errors.raise_first()  # superseded steps are no error
        assert remote.steps() == [1, 5, 6, 7]
    finally:
        faults.hold.set()


def test_each_steps_outcome_settles_with_its_commit_or_its_upload_error(job):
    _store, remote, faults, start = job
    faults.failures.append(PermissionError("AccessDenied"))
    uploader = start()
    outcomes = {step: uploader.outcome(step) for step in (1, 2)}
    assert uploader.outcome(1) is outcomes[1]  # one future per step
    for step in (1, 2):
        uploader.submit(step)
    uploader.wait()
    failed = outcomes[1].exception(timeout=60)
    assert isinstance(failed, UploadError) and failed.step == 1 and not failed.transient
    assert outcomes[2].result(timeout=60) is None and remote.steps() == [2]
    with pytest.raises(UploadError, match="step 1"):
        uploader.errors.raise_first()  # exception() only looks: the error is still the box's to raise


def test_an_error_raised_by_an_outcome_is_not_raised_again_by_the_box(job):
    _store, _remote, faults, start = job
    faults.failures.append(PermissionError("AccessDenied"))
    uploader = start()
    outcome = uploader.outcome(1)
    uploader.submit(1)
    with pytest.raises(UploadError, match="step 1"):
        outcome.result(timeout=60)
    uploader.wait()
    uploader.errors.raise_first()  # raised once already


def test_abandon_fails_a_steps_outcome_with_the_error_given(job):
    from tiered_ckpt import SaveError

    _store, _remote, _faults, start = job
    uploader = start()
    outcome = uploader.outcome(7)
    error = SaveError("background save of step 7 failed", step=7)
    uploader.abandon(7, error)
    assert outcome.exception(timeout=0) is error
    uploader.abandon(8, error)  # no outcome asked for: nothing to settle


def test_close_settles_every_outcome_and_a_submit_after_close_is_a_usage_error(job):
    _store, remote, faults, start = job
    faults.hold.clear()
    uploader = start(max_pending=2)
    outcomes = {step: uploader.outcome(step) for step in (1, 2, 3)}
    uploader.submit(1)
    faults.holding.wait()  # step 1 is being put; 2 waits in the queue; 3 is never submitted
    uploader.submit(2)
    closing = threading.Thread(target=uploader.close)
    closing.start()
    faults.hold.set()
    closing.join()
    # close finishes the queued uploads; a step never submitted is settled as staying local-only
    assert outcomes[1].result(timeout=0) is None and outcomes[2].result(timeout=0) is None
    assert remote.steps() == [1, 2]
    error = outcomes[3].exception(timeout=0)
    assert isinstance(error, UploadError) and error.step == 3 and error.transient
    assert "step 3 stays local-only" in str(error) and "closed before it was sent" in str(error)
    with pytest.raises(UsageError, match="is closed") as caught:
        uploader.submit(4)
    assert isinstance(caught.value, ValueError) and not isinstance(caught.value, RuntimeError)


def test_retry_policy_stops_at_its_time_budget():
    clock = [0.0]
    calls = []

    def failing():
        calls.append(clock[0])
        clock[0] += 10  # each try takes 10 s
        raise RemoteError("slow down", transient=True)

    policy = RetryPolicy(max_tries=100, backoff_seconds=0, max_seconds=25)
    with pytest.raises(RemoteError) as caught:
        policy.run("op", failing, sleep=lambda _s: None, clock=lambda: clock[0])
    assert caught.value.tries == 3 and len(calls) == 3  # tries at 0, 10, 20 s; none starts past 25 s


def test_retry_policy_backs_off_exponentially_with_jitter():
    delays = []
    outcomes = iter([RemoteError("x", transient=True)] * 4 + [None])

    def action():
        error = next(outcomes)
        if error:
            raise error
        return "done"

    policy = RetryPolicy(max_tries=5, backoff_seconds=1, max_backoff_seconds=4)
    assert policy.run("op", action, sleep=delays.append) == "done"
    assert len(delays) == 4 and all(0 <= delay <= bound for delay, bound in zip(delays, [1, 2, 4, 4], strict=True))


def test_resume_queues_unuploaded_steps_and_removes_half_uploaded_ones(job):
    store, remote, faults, start = job
    record = store.local.manifest(4).shard(0)
    remote.land_shard(
        4, record, ShardSource(path=store.local.shard_path(4, record))
    )  # a half upload of step 4, no manifest
    assert remote.uncommitted_steps() == [4]
    committed = store.local.manifest(2).shard(0)
    landed = remote.land_shard(2, committed, ShardSource(path=store.local.shard_path(2, committed)))
    remote.commit(store.local.manifest(2), landed=[landed])  # step 2 committed remotely, the receipt lost in a crash
    uploader = start()
    assert uploader.resume() == [3, 4]  # newer than the newest remote commit; step 1 is superseded
    uploader.wait()
    assert store.receipted(2) and remote.steps() == [2, 3, 4]


def test_after_a_preemption_notice_the_newest_step_goes_next_and_older_queued_steps_are_dropped(job):
    store, remote, faults, start = job
    faults.hold.clear()
    uploader = start(max_pending=1, when_behind="wait")
    uploader.submit(1)
    faults.holding.wait()  # step 1 is being put
    uploader.submit(2)
    uploader.preempt()
    uploader.submit(3)  # a full queue no longer blocks the submitter once preempted
    uploader.submit(4)
    assert uploader.pending() == [1, 2, 3, 4]
    faults.hold.set()
    uploader.wait()
    uploader.errors.raise_first()
    assert remote.steps() == [1, 4]  # the step in flight finishes; 2 and 3 are superseded
    assert faults.puts == [1, 4]
    assert not store.receipted(2) and not store.receipted(3)


def test_after_a_preemption_notice_a_step_retried_for_a_failing_bucket_gives_way_to_the_newest(job):
    store, remote, faults, start = job
    faults.down = True
    uploader = start(max_pending=1)
    outcomes = {step: uploader.outcome(step) for step in (1, 2, 3)}
    uploader.submit(1)
    while uploader.retrying() is None:  # its first try failed (guarded by the test timeout)
        faults.failed.wait()
    uploader.submit(2)
    uploader.preempt()
    uploader.submit(3)
    while uploader.pending() != [3]:  # step 1 given up, step 2 dropped (guarded by the test timeout)
        faults.failed.wait()
    faults.down = False
    uploader.wait()
    uploader.errors.raise_first()  # superseded, not failed
    assert remote.steps() == [3] and not store.receipted(1)
    assert outcomes[3].result(timeout=60) is None
    for step in (1, 2):  # neither reached the bucket: their futures say so, as transient
        error = outcomes[step].exception(timeout=60)
        assert isinstance(error, UploadError) and error.transient and "superseded" in str(error), (step, error)


def test_asking_a_settled_outcome_twice_or_one_never_put_in_the_box_hides_no_later_failure(job):
    _store, _remote, _faults, start = job
    uploader = start()
    outcome = uploader.outcome(5)
    uploader.abandon(5, UploadError("step 5 stays local-only: test", step=5, tries=0, transient=True))
    for _ in range(2):
        with pytest.raises(UploadError):
            outcome.result()
    later = UploadError("upload of step 5 failed: access denied", step=5, tries=1)
    uploader.errors.put(later)
    with pytest.raises(UploadError, match="access denied"):
        uploader.errors.raise_first()


# -- a third tier: a tier and a policy ---------------------------------------------------------


def save_locally(root, *steps):
    for step in steps:
        save_sharded([{"w": np.full(64, step, np.float32)}], root / step_dir_name(step), step=step)


def test_a_replicator_to_a_partner_memory_commits_there_and_leaves_no_receipt(tmp_path):
    save_locally(tmp_path / "ckpt", 1, 2, 3)
    peer = MemoryTier("peer")
    retention = {"local": RetentionPolicy(keep_last=1), "peer": RetentionPolicy(keep_last=2)}
    store = TieredStore([LocalTier(tmp_path / "ckpt"), peer], retention)
    with store.local.lock():
        replicator = Replicator(store, peer, errors=ErrorBox())
        try:
            assert replicator.resume() == [3]  # a memory lost what it held: only the newest step goes again
            replicator.wait()
            replicator.errors.raise_first()
            assert peer.steps() == [3] and peer.check_shard(3, store.local.manifest(3).shard(0)) is None
            assert not store.receipted(3, peer) and store.local.steps() == [3]  # a memory's copy protects nothing
            save_locally(tmp_path / "ckpt", 4, 5)
            for step in (4, 5):
                replicator.submit(step)
            replicator.wait()
            replicator.errors.raise_first()
            assert peer.steps() == [4, 5] and replicator.newest_committed == 5  # the peer's own retention
        finally:
            replicator.close()


def test_a_replicator_needs_a_target_among_the_stores_later_tiers(tmp_path):
    store = TieredStore([LocalTier(tmp_path / "ckpt")])
    with pytest.raises(UsageError, match="needs a target among the store's later tiers"):
        Replicator(store)
    with pytest.raises(UsageError, match="needs a target among the store's later tiers"):
        Replicator(store, MemoryTier("peer"))  # a tier the store does not have


def test_a_slow_partner_fails_no_save_its_queued_steps_stay_on_disk(tmp_path):
    save_locally(tmp_path / "ckpt", 1, 2, 3)
    gate = threading.Event()

    class SlowPeer(MemoryTier):
        def land_shard(self, *args, **kwargs):
            gate.wait()
            return super().land_shard(*args, **kwargs)

    peer = SlowPeer("peer")
    store = TieredStore([LocalTier(tmp_path / "ckpt"), peer], {"local": RetentionPolicy(keep_last=1)})
    with store.local.lock():
        replicator = Replicator(store, peer, errors=ErrorBox())
        try:
            for step in (1, 2, 3):
                replicator.submit(step, bounded=False)
            gate.set()
            replicator.wait()
            replicator.errors.raise_first()  # no step was deleted under its replication
            assert peer.steps() == [1, 2, 3] and store.local.steps() == [3]
        finally:
            replicator.close()


def test_a_step_a_partner_memory_never_got_is_named_not_in_that_tier_not_local_only(tmp_path):
    save_locally(tmp_path / "ckpt", 1)
    peer = MemoryTier("peer")
    store = TieredStore([LocalTier(tmp_path / "ckpt"), peer])
    with store.local.lock():
        replicator = Replicator(store, peer, errors=ErrorBox())
        never_sent = replicator.outcome(1)
        replicator.close()
    error = never_sent.exception(timeout=0)
    assert isinstance(error, UploadError) and error.transient
    assert "step 1 is not in the peer tier" in str(error) and "local-only" not in str(error)


def test_replicators_sharing_a_backlog_keep_each_others_queues(job, tmp_path):
    store, remote, faults, _start = job
    peer = MemoryTier("peer")
    store = TieredStore([store.local, peer, remote], {"local": RetentionPolicy(keep_last=1, max_awaiting_upload=1)})
    backlog = Backlog()
    faults.hold.clear()  # the bucket's first PUT waits
    to_bucket = Replicator(store, remote, errors=ErrorBox(), backlog=backlog)
    to_peer = Replicator(store, peer, errors=ErrorBox(), backlog=backlog)
    try:
        for step in (2, 3):
            to_bucket.submit(step, bounded=False)
        faults.holding.wait()  # step 2 is being put
        to_peer.submit(4)
        to_peer.wait()
        to_peer.errors.raise_first()
        assert peer.steps() == [4] and store.local.steps() == [2, 3, 4]  # step 1 went; the bucket's queue stayed
        faults.hold.set()
        to_bucket.wait()
        to_bucket.errors.raise_first()
        assert remote.steps() == [2, 3]
    finally:
        faults.hold.set()
        to_peer.close()
        to_bucket.close()
