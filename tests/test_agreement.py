"""The options every rank must share (tiered_ckpt/agreement.py): ranks whose options differ where
they decide the ranks' collectives all raise a ConfigError naming the option and the ranks, at
construction, instead of waiting for each other until the coordinator's timeout."""

import re
from pathlib import Path

import pytest

from support.processes import launch_ranks
from tiered_ckpt import ConfigError, LocalOptions, PeerOptions, RemoteOptions, RuntimeOptions, UploadOptions
from tiered_ckpt.agreement import Shared, _differences, agree_on_options, check_process_layout
from tiered_ckpt.dist.coordination import Attempt
from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.options import resolve_options

WORKER = Path(__file__).resolve().parent / "support" / "rank_worker.py"


class Ranks:
    """A coordinator of one process per rank whose gathers return what each rank sent (``sent``)."""

    def __init__(self, sent):
        self.world_size, self.local_ranks, self.is_leader = len(sent), (0,), True
        self._sent = sent

    def all_gather(self, payload):
        return [{"result": {"values": [list(pair) for pair in shared.values]}} for shared in self._sent]


def shared(**options):
    return Shared.of(resolve_options(options.pop("local", "/ckpt"), **options))


def test_ranks_with_the_same_options_agree_and_a_rank_whose_options_fail_fails_there():
    options = resolve_options("/ckpt", "memory://b/run", peer=PeerOptions(every=5))
    same = Shared.of(options)
    assert agree_on_options(Ranks([same, same, same]), Attempt(options)) is options
    with pytest.raises(ConfigError, match="^mine$"):
        agree_on_options(Ranks([same, same]), Attempt(error=ConfigError("mine")))
    skipping = resolve_options("/ckpt", upload=UploadOptions(when_behind="skip"))
    with pytest.raises(ConfigError, match="^upload.when_behind is 'skip'"):  # its check of the job's shape
        agree_on_options(Ranks([same, same]), Attempt(skipping))


def test_each_option_that_differs_is_named_with_each_value_and_the_ranks_holding_it():
    usual = shared(local=LocalOptions("/ckpt", every=2), remote=RemoteOptions("memory://b/run", every=2))
    odd = shared(local=LocalOptions("/ckpt", every=4), remote=RemoteOptions("memory://b/run", every=8))
    assert _differences([usual, usual, odd, usual, odd]) == {
        "local.every": "2 on ranks 0-1,3, 4 on ranks 2,4",
        "remote.every": "2 on ranks 0-1,3, 8 on ranks 2,4",
    }
    with pytest.raises(ConfigError, match=r"^local.every is 2 on ranks 0-1, 4 on rank 2; remote.every is 2 on") as e:
        agree_on_options(Ranks([usual, usual, odd]), Attempt(resolve_options("/ckpt")))
    assert e.value.field == "local.every" and "TIERED_CKPT_LOCAL_EVERY set on some nodes only" in str(e.value)


def test_a_tier_on_some_ranks_only_is_named_without_each_of_its_fields():
    with_peer, without = shared(peer=PeerOptions(every=5, nodes=("a", "b"))), shared()
    assert _differences([without, with_peer]) == {"peer": '"off" on rank 0, "on" on rank 1'}
    assert _differences([shared(remote="memory://b/x"), shared()]) == {"remote": '"on" on rank 0, "off" on rank 1'}


def test_a_long_value_is_compared_whole_and_shown_by_its_digest():
    keys = [f"layer{index}.weight" for index in range(50)]
    first, second = (shared(runtime=RuntimeOptions(sharded_keys=names)) for names in (keys, [*keys, "bias"]))
    assert shared(runtime=RuntimeOptions(sharded_keys=keys[::-1])) == first  # a set of keys: in any order
    (shown,) = _differences([first, second]).values()
    assert re.fullmatch(r"a value of \d+ characters with sha256 [0-9a-f]{16} on rank 0, .* on rank 1", shown)


def test_skipping_steps_is_refused_with_one_process_per_rank(tmp_path):
    options = resolve_options(tmp_path, upload=UploadOptions(when_behind="skip"))
    check_process_layout(options, one_process=True)  # one process holds every rank: fine
    with pytest.raises(ConfigError, match="^upload.when_behind is 'skip'") as caught:
        check_process_layout(options, one_process=False)
    assert caught.value.field == "upload.when_behind"


# --- real rank processes, a variable set on one node only ----------------------------------------


def launch(tmp_path, env_by_rank, actions=()):
    """Two ranks of one job configured by a config file and their own environments. The
    coordinator waits torch's default 30 minutes; the launch fails the test if the ranks
    are not done well before (the guard against the hang this file is about)."""
    config_file = tmp_path / "ckpt.toml"
    config_file.write_text("[local]\ndir = 'unused'\n")
    config = {"actions": [{"do": "save", "step": 1}, {"do": "save", "step": 2}, *actions], "timeout_seconds": 1800}
    config["config_file"] = str(config_file)
    return launch_ranks(WORKER, tmp_path, 2, config, env_by_rank=env_by_rank, limit=120)


@pytest.mark.slow
@pytest.mark.parametrize(
    "variable, value, named",
    [
        ("TIERED_CKPT_LOCAL_EVERY", "2", "local.every'? is 1 on rank 0, 2 on rank 1"),
        ("TIERED_CKPT_PEER_EVERY", "5", 'peer\'? is "off" on rank 0, "on" on rank 1'),
    ],
)
def test_a_variable_set_on_one_rank_only_fails_every_rank_at_construction_naming_it(tmp_path, variable, value, named):
    results = launch(tmp_path, {1: {variable: value}})
    for rank, result in results.items():
        kind, message = result["error"]
        assert kind == "ConfigError" and re.search(named, message), (rank, result)
        assert "every rank must be given the same" in message
    assert "environment (" + variable in results[1]["error"][1]  # the rank that has it names where it came from
    assert not any((tmp_path / "nodes" / f"rank-{rank}" / step_dir_name(1)).exists() for rank in (0, 1))


@pytest.mark.slow
def test_options_one_rank_refuses_for_a_variable_only_it_has_fail_every_rank_at_construction(tmp_path):
    bucket = {"TIERED_CKPT_REMOTE_URL": f"file://{tmp_path}/bucket"}  # the bucket's cadence is 1: every disk step
    results = launch(tmp_path, {0: bucket, 1: {**bucket, "TIERED_CKPT_LOCAL_EVERY": "2"}})
    for result in results.values():
        kind, message = result["error"]
        assert kind == "ConfigError" and "remote.every is 1, not a multiple of local.every (2)" in message, result
    assert results[0]["error"][1].startswith('rank 1 (during "options"): ')


@pytest.mark.slow
def test_peer_nodes_naming_fewer_ranks_than_the_job_is_a_config_error_on_every_rank(tmp_path):
    nodes = {"TIERED_CKPT_PEER_NODES": "a"}
    for result in launch(tmp_path, {0: nodes, 1: nodes}).values():
        kind, message = result["error"]
        assert kind == "ConfigError" and "key 'peer.nodes' names the node of 1 rank, but the job has 2" in message
