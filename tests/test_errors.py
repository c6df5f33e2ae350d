"""The error tree (tiered_ckpt.errors): five groups that say what to do, misuse as a ValueError,
no bare builtin raised on purpose, and another rank's failure carried as one error naming the rank."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import tiered_ckpt
from tiered_ckpt import errors
from tiered_ckpt.dist.coordination import _describe_error, _error_from

GROUPS = {
    errors.CorruptCheckpointError: {
        errors.ManifestError,
        errors.ShardCountMismatchError,
        errors.ChecksumMismatchError,
        errors.IncompleteCheckpointError,
        errors.ShardFormatError,
    },
    errors.StorageError: {
        errors.RemoteError,
        errors.RemoteInUseError,
        errors.DirectoryInUseError,
        errors.PeerError,
        errors.MemoryBudgetError,
    },
    errors.BackgroundError: {errors.SaveError, errors.UploadError},
    errors.UsageError: {
        errors.ConfigError,
        errors.InvalidStateError,
        errors.CheckpointExistsError,
        errors.CheckpointNotFoundError,
        errors.WorldSizeMismatchError,
        errors.ReshardError,
    },
    errors.CoordinationError: {errors.RankFailedError},
}


def test_every_error_is_in_exactly_one_group_under_checkpoint_error():
    for group, members in GROUPS.items():
        assert group.__bases__ == (errors.CheckpointError,) or group is errors.UsageError
        for member in members:
            assert issubclass(member, group)
            assert [other for other in GROUPS if issubclass(member, other)] == [group]
    grouped = set(GROUPS) | set().union(*GROUPS.values()) | {errors.CheckpointError}
    assert set(errors.TREE.values()) == grouped


def test_every_class_of_the_tree_is_exported_and_misuse_is_also_a_value_error():
    assert {name for name in errors.TREE} <= set(tiered_ckpt.__all__)
    for kind in {errors.UsageError, *GROUPS[errors.UsageError]}:
        assert issubclass(kind, ValueError)
    for group in set(GROUPS) - {errors.UsageError}:
        assert not issubclass(group, ValueError)


def test_a_background_error_carries_its_step():
    assert errors.SaveError("x", step=3).step == 3
    upload = errors.UploadError("x", step=4, tries=2, transient=True)
    assert (upload.step, upload.tries, upload.transient) == (4, 2, True)


RETRYABLE = {
    errors.RemoteError,
    errors.RemoteInUseError,
    errors.PeerError,
    errors.MemoryBudgetError,
    errors.UploadError,
}


def test_the_errors_another_try_may_cure_are_retryable_and_declare_its_fields_once():
    assert {kind for kind in errors.TREE.values() if issubclass(kind, errors.Retryable)} == RETRYABLE
    assert tiered_ckpt.Retryable is errors.Retryable and errors.Retryable not in errors.TREE.values()
    for kind in errors.TREE.values():  # one declaration of each field: the mixin's
        assert not {"transient", "tries"} & set(vars(kind).get("__annotations__", {}))
    remote, peer = errors.RemoteError("x", transient=True), errors.PeerError("y", transient=False)
    assert (remote.transient, remote.tries, peer.transient, peer.tries) == (True, 1, False, 1)
    assert errors.as_upload_error(5, remote).tries == 1 and errors.as_upload_error(5, peer, tries=3).tries == 3


PACKAGE = Path(tiered_ckpt.__file__).parent


def test_no_module_probes_an_error_for_its_retry_fields():
    probe = re.compile(r"getattr\([^)]*[\"'](transient|tries)[\"']")
    found = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if probe.search(line)
    ]
    assert not found, "\n".join(found)


# Internal parsers whose callers turn their ValueError into an error of the tree, and checks of
# the library's own bugs (a call site returning the wrong type), which no caller should catch.
# (The io layer raises OSError as the OS does; the tiers turn it into an error of the tree.)
INTERNAL = {
    "format/state.py": "TypeError",  # -> InvalidStateError naming the array (a bool as a dimension)
    "format/shardfile.py": "ValueError",  # -> ShardFormatError, naming the file
    "format/strict_json.py": "ValueError",  # -> ManifestError / ShardFormatError
    "format/structure.py": "KeyError",  # -> InvalidStateError / ShardFormatError
    "torch/tensors.py": "ValueError",  # -> ShardFormatError (as_complex of stored pairs)
    "dist/coordination.py": "TypeError",  # a collective's action returned another type: a bug
}
MAPPINGS = {"format/dtypes.py": "KeyError"}  # DTYPE_CODES is a Mapping: a lookup raises what a dict's does


def test_no_bare_builtin_is_raised_on_purpose_outside_internal_parsers():
    raised = re.compile(r"raise (ValueError|TypeError|RuntimeError|KeyError|IndexError)\b")
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(PACKAGE))
        for number, line in enumerate(path.read_text().splitlines(), 1):
            match = raised.search(line)
            allowed = {INTERNAL.get(name), MAPPINGS.get(name)}
            if match and match.group(1) not in allowed and "raise ValueError\n" not in line + "\n":
                found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


# -- another rank's failure --------------------------------------------------------------------------


def carried(error: BaseException, rank: int = 3, label: str = "commit") -> errors.CheckpointError:
    """``error`` as another process raises it after a collective: described, sent as JSON, rebuilt."""
    return _error_from(json.loads(json.dumps(_describe_error(error))), rank, label)


def test_an_error_of_the_tree_arrives_as_its_class_with_its_fields_and_the_rank():
    upload = carried(errors.UploadError("upload of step 4 failed", step=4, tries=2, transient=True))
    assert type(upload) is errors.UploadError and upload.rank == 3
    assert (upload.step, upload.tries, upload.transient) == (4, 2, True)
    assert str(upload) == 'rank 3 (during "commit"): upload of step 4 failed'
    exists = carried(errors.CheckpointExistsError("rank 3: step 7 exists"))
    assert type(exists) is errors.CheckpointExistsError and str(exists) == 'rank 3 (during "commit"): step 7 exists'
    assert errors.CheckpointExistsError("mine").rank is None


@pytest.mark.parametrize(
    "error, kind",
    [(OSError(5, "Input/output error"), "OSError"), (ZeroDivisionError("division by zero"), "ZeroDivisionError")],
)
def test_any_other_exception_arrives_as_one_rank_failed_error_with_rank_kind_and_message(error, kind):
    failed = carried(error)
    assert type(failed) is errors.RankFailedError and isinstance(failed, errors.CoordinationError)
    assert (failed.rank, failed.kind, failed.message) == (3, kind, str(error))
    assert str(failed) == f'rank 3 (during "commit") failed with {kind}: {error}'


def test_a_rank_failed_error_passed_on_keeps_the_rank_kind_and_message_of_its_origin():
    first = carried(OSError("disk gone"), rank=2, label="write")
    again = carried(first, rank=2, label="next step")
    assert (again.rank, again.kind, again.message) == (2, "OSError", "disk gone")


def test_an_error_class_not_of_the_tree_is_never_looked_up_by_name():
    description = {"type": "ErrorBox", "kind": "ErrorBox", "message": "m", "attributes": {}}
    assert type(_error_from(description, 1, "x")) is errors.RankFailedError
