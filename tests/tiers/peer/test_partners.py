"""Partners chosen from the ranks' nodes (tiered_ckpt.tiers.peer.partners): never on the same node."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiered_ckpt import ConfigError, UsageError
from tiered_ckpt.tiers.peer.partners import choose_partners, node_of


def test_two_nodes_of_two_hold_each_other_rank_by_rank():
    partners = choose_partners(["a", "a", "b", "b"])
    assert partners.partner == (2, 3, 0, 1)
    assert partners.active
    assert partners.wards(2) == (0,) and partners.wards(0) == (2,)


def test_three_uneven_nodes_form_a_ring_and_a_smaller_node_holds_more_than_one_rank():
    partners = choose_partners(["a", "a", "a", "b", "c", "c"])
    assert partners.partner == (3, 3, 3, 4, 0, 1)  # node a -> b -> c -> a
    assert partners.wards(3) == (0, 1, 2)


def test_one_node_gives_no_rank_a_partner():
    partners = choose_partners(["host"] * 4)
    assert partners.partner == (None,) * 4
    assert not partners.active


def test_no_ranks_is_refused():
    with pytest.raises(UsageError, match="node of every rank"):
        choose_partners([])


@given(st.lists(st.sampled_from("abcde"), min_size=1, max_size=40))
def test_a_partner_is_never_on_the_same_node_and_every_rank_is_held_once(nodes):
    partners = choose_partners(nodes)
    if len(set(nodes)) == 1:
        assert not partners.active
        return
    assert partners.active
    for rank, holder in enumerate(partners.partner):
        assert holder is not None and nodes[holder] != nodes[rank]
    assert sorted(ward for rank in range(len(nodes)) for ward in partners.wards(rank)) == list(range(len(nodes)))


def test_the_node_comes_from_the_mapping_then_the_launcher_then_the_host_name():
    env = {"GROUP_RANK": "3", "RANK": "5", "LOCAL_WORLD_SIZE": "2"}
    assert node_of(1, ("x", "y"), env) == "y"
    assert node_of(5, None, env) == "group-rank-3"
    assert node_of(5, None, {"RANK": "5", "LOCAL_WORLD_SIZE": "2"}) == "group-rank-2"
    import socket

    assert node_of(0, None, {}) == socket.gethostname()


def test_a_mapping_that_does_not_name_this_rank_is_a_config_error_naming_the_option():
    with pytest.raises(ConfigError, match="^peer.nodes names 2 ranks, but this process is rank 3$") as caught:
        node_of(3, ("a", "b"), {})
    assert caught.value.field == "peer.nodes"
