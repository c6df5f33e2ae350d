"""One rank of an FSDP2 test job: ``python fsdp_worker.py CONFIG_JSON RANK``.

Joins a gloo job through a file store, shards a small model with ``fully_shard`` on a
CPU device mesh, and either trains it a few steps and saves ``get_state_dict(model,
optimizer)`` ("save"), or builds it afresh (other initial values) and restores into its
state dict ("restore", any world size); with ``wide``, a model whose chunks are large enough to be
referenced, and with ``frozen`` the save also saves step 4, its first layer frozen after step 3
(an incremental save references that layer and its AdamW moments). Either way it writes to
``<results>/rank-<RANK>.json`` the sha256 of every tensor of the full (unsharded) state,
and what the restore read from where. A CheckpointError is recorded as ``error``. With
``nodes`` (a node name per rank) the job has a peer tier, each node's memory in
``<root>/memory-<node>``.
"""

import hashlib
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tiered_ckpt import CheckpointError, CheckpointManager, PeerOptions, RemoteOptions, TorchDistributedCoordinator

WIDE = 64  # the inputs and hidden width of the "wide" model, whose chunks are large enough to be referenced


def build(seed: int, world_size: int, wide: bool = False):
    torch.manual_seed(seed)
    if wide:
        layers = [torch.nn.Linear(WIDE, WIDE), torch.nn.Tanh(), torch.nn.Linear(WIDE, WIDE), torch.nn.Linear(WIDE, 2)]
    else:
        layers = [torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3), torch.nn.Linear(3, 2)]
    model = torch.nn.Sequential(*layers)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def digests(state, whole: bool) -> dict[str, str]:
    """The sha256 of every tensor of a (nested) state: DTensors gathered whole (``whole``), or
    as this rank holds them (their local chunks); with ``whole``, scalars by their repr too."""
    found = {}

    def walk(value, path):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}/{key}")
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(item, f"{path}/{index}")
        elif isinstance(value, torch.Tensor):
            if isinstance(value, DTensor):
                value = value.full_tensor() if whole else value.to_local()
            data = hashlib.sha256(value.contiguous().numpy().tobytes()).hexdigest()
            found[path] = f"{value.dtype} {tuple(value.shape)} {data}" if whole else data
        elif whole:
            found[path] = repr(value)

    walk(state, "")
    return found


def full_digests(state) -> dict[str, str]:
    return digests(state, whole=True)


def local_digests(state) -> dict[str, str]:
    return digests(state, whole=False)


def extras(rank: int, wide: bool = False) -> dict:
    """Plain tensors beside the FSDP2 state: one the same on every rank, one of each rank's own."""
    table = torch.arange(2000 if wide else 1000, dtype=torch.float32)
    return {"table": table, "seed": torch.tensor([rank], dtype=torch.int64)}


def train(model, optimizer, steps, wide: bool = False) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        model(torch.randn(4, WIDE if wide else 5, generator=generator)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def trained(world_size: int, wide: bool = False):
    model, optimizer = build(0, world_size, wide)
    train(model, optimizer, range(3), wide)
    return model, optimizer


def run_dcp(do: str, manager: CheckpointManager, world_size: int, result: dict) -> None:
    """Save or load the same state through torch.distributed.checkpoint with the tiered backend."""
    import torch.distributed.checkpoint as dcp

    from tiered_ckpt.torch import TieredReader, TieredWriter

    if do in ("dcp_save", "dcp_async_save"):
        model, optimizer = trained(world_size)
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        if do == "dcp_save":
            dcp.save(state, storage_writer=TieredWriter(manager, 3))
        else:
            dcp.async_save(state, storage_writer=TieredWriter(manager, 3)).result()
        manager.wait(uploaded=True)
    else:
        model, optimizer = build(1234, world_size)
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, storage_reader=TieredReader(manager))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        model_state, optim_state = get_state_dict(model, optimizer)
    result["digests"] = full_digests({"model": model_state, "optim": optim_state})


def run(config: dict, rank: int, world_size: int, result: dict) -> None:
    coordinator = TorchDistributedCoordinator()
    directory = Path(config["local_root"]) / f"rank-{rank}"
    url = config.get("url")
    remote = RemoteOptions(url, storage_options=config.get("options") or {}) if url is not None else None
    nodes = config.get("nodes")  # a node name per rank: a peer tier, each node's memory in <root>/memory-<node>
    peer = PeerOptions(nodes=tuple(nodes), memory_dir=Path(config["root"]) / f"memory-{nodes[rank]}") if nodes else None
    with CheckpointManager(directory, coordinator=coordinator, remote=remote, peer=peer) as manager:
        if config["do"].startswith("dcp_"):
            run_dcp(config["do"], manager, world_size, result)
            return
        wide = bool(config.get("wide"))
        if config["do"] == "save":
            model, optimizer = trained(world_size, wide)
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optim_state, "epoch": 3, "extras": extras(rank, wide)}
            manager.save(3, state, blocking=True)
            if config.get("frozen"):  # step 4: the first layer frozen, the rest trained one step more
                for parameter in model[0].parameters():
                    parameter.requires_grad_(False)
                train(model, optimizer, [3], wide)
                model_state, optim_state = get_state_dict(model, optimizer)
                state = {"model": model_state, "optim": optim_state, "epoch": 4, "extras": extras(rank, wide)}
                manager.save(4, state, blocking=True)
            manager.wait(uploaded=True)
            result["local"] = local_digests(state)
        elif config["do"] in ("restore_plain", "restore_model", "restore_extras"):  # no into: as saved
            part = config["do"].removeprefix("restore_")
            restored = manager.restore(paths=None if part == "plain" else [part])
            result["local"] = local_digests(restored.torch_state())
            result["sources"] = {str(old): tier for old, tier in restored.sources.items()}
            return
        else:
            model, optimizer = build(1234, world_size, wide)  # other values: the restore must replace them all
            model_state, optim_state = get_state_dict(model, optimizer)
            into = {"model": model_state, "optim": optim_state, "epoch": 0, "extras": extras(-1, wide)}
            into["extras"]["table"].zero_()
            restored = manager.restore(into=into, reshard=True)
            optim_state["param_groups"] = restored.torch_state()["optim"]["param_groups"]
            set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optim_state, "epoch": restored.state["epoch"]}
            state["extras"] = {"table": into["extras"]["table"]}
            result["seed"] = int(into["extras"]["seed"])
            result["sources"] = {str(old): tier for old, tier in restored.sources.items()}
        result["digests"] = full_digests({**state, "extras": {"table": state["extras"]["table"]}})


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    rank = int(sys.argv[2])
    world_size = config["world_size"]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{config['store']}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    result: dict = {"rank": rank}
    try:
        run(config, rank, world_size, result)
    except CheckpointError as exc:
        result["error"] = [type(exc).__name__, str(exc)]
    (Path(config["results"]) / f"rank-{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
