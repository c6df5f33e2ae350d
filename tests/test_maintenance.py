"""pull, push, prune and lag (tiered_ckpt/maintenance.py): one implementation for the manager and the CLI."""

import numpy as np
import pytest

from tiered_ckpt import CheckpointManager, RemoteOptions, UsageError, maintenance
from tiered_ckpt.tiers.remote.leases import OwnershipPolicy


def test_the_orphan_age_and_the_lease_defaults_are_the_ownership_policys():
    remote, policy = RemoteOptions("s3://bucket/run"), OwnershipPolicy()
    assert remote.ownership == policy
    assert (remote.orphan_age_seconds, remote.lease_seconds) == (policy.orphan_age_seconds, policy.lease_seconds)


def test_a_maintenance_operation_needs_one_process_holding_every_rank():
    maintenance.check_one_process("prune", 4, 4)
    with pytest.raises(UsageError, match="prune is a maintenance operation of one process holding every rank"):
        maintenance.check_one_process("prune", 1, 4)


def test_the_managers_maintenance_waits_for_its_writes_then_runs_on_its_store(tmp_path):
    with CheckpointManager(tmp_path, world_size=2) as manager:
        manager.save(1, [{"w": np.zeros(4, np.float32)}] * 2)  # not waited for: the prune waits
        with pytest.raises(UsageError, match="push needs a remote tier"):
            manager.push()
        pruned = manager.prune(dry_run=True)
        assert pruned.deleted == {"local": ()} and pruned.dry_run
        assert pruned.aborted == () and pruned.kept_unproven == ()
        assert manager.steps() == [1]
