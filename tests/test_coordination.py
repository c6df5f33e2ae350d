import pytest

from tiered_ckpt import Coordinator, SingleProcessCoordinator


def test_single_process_coordinator_holds_every_rank_and_leads():
    coordinator = SingleProcessCoordinator(4)
    assert isinstance(coordinator, Coordinator)
    assert list(coordinator.local_ranks) == [0, 1, 2, 3]
    assert coordinator.is_leader and coordinator.world_size == 4
    assert coordinator.all_gather({"step": 3}) == [{"step": 3}]
    assert coordinator.broadcast(7) == 7
    coordinator.barrier()


@pytest.mark.parametrize("world_size", [0, -1, 2.0, True])
def test_single_process_coordinator_rejects_a_bad_world_size(world_size):
    with pytest.raises(ValueError, match="world_size"):
        SingleProcessCoordinator(world_size)
