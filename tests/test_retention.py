import pytest

from tiered_ckpt import ConfigError
from tiered_ckpt.retention import RetentionPolicy, awaiting_upload, protected_locally


@pytest.mark.parametrize(
    "policy, steps, protected, deleted",
    [
        (RetentionPolicy(), [1, 2, 3], (), []),  # keep_last=None keeps everything
        (RetentionPolicy(keep_last=2), [1, 2, 3, 4], (), [1, 2]),
        (RetentionPolicy(keep_last=1, keep_every=10), [5, 10, 15, 20, 25], (), [5, 15]),
        (RetentionPolicy(keep_last=1), [3, 1, 2], (), [1, 2]),  # any order in, oldest first out
        (RetentionPolicy(keep_last=1), [1, 2, 3], (1,), [2]),  # protected steps stay
        (RetentionPolicy(keep_last=1), [], (), []),
    ],
)
def test_policy_deletes_what_it_should(policy, steps, protected, deleted):
    assert policy.to_delete(steps, protected) == deleted


def test_the_newest_step_is_never_deleted():
    assert RetentionPolicy(keep_last=1).to_delete([7]) == []
    assert 9 not in RetentionPolicy(keep_last=1, keep_every=4).to_delete([4, 8, 9])


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "3"])
def test_bad_keep_values_are_refused_naming_the_field(value):
    with pytest.raises(ConfigError, match="keep_last") as caught:
        RetentionPolicy(keep_last=value)
    assert caught.value.field == "keep_last"
    with pytest.raises(ConfigError, match="keep_every"):
        RetentionPolicy(keep_every=value)


def test_awaiting_upload_protects_unreceipted_pending_and_newer_steps():
    steps = [1, 2, 3, 4, 5]
    # 2 and 4 are committed remotely; 3 was skipped (superseded by 4); 5 is newer than any commit
    assert awaiting_upload(steps, receipted={2, 4}, pending=()) == {5}
    assert awaiting_upload(steps, receipted={2, 4}, pending=(3,)) == {3, 5}
    assert awaiting_upload(steps, receipted=set(), pending=()) == set(steps)


def test_a_bound_protects_only_the_newest_waiting_steps_and_those_queued():
    steps = list(range(1, 11))  # the bucket has been down since step 2
    assert protected_locally(steps, receipted={1}, pending=(), limit=None) == set(range(2, 11))
    assert protected_locally(steps, receipted={1}, pending=(), limit=3) == {8, 9, 10}
    assert protected_locally(steps, receipted={1}, pending=(4,), limit=3) == {4, 8, 9, 10}  # queued: kept
    policy = RetentionPolicy(keep_last=1, max_awaiting_upload=3)
    assert policy.to_delete(steps, protected_locally(steps, {1}, (), policy.max_awaiting_upload)) == list(range(1, 8))
    with pytest.raises(ConfigError, match="max_awaiting_upload"):
        RetentionPolicy(max_awaiting_upload=0)
