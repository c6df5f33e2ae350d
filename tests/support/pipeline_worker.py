"""One rank of a pipeline x data parallel job (2 stages x 2 replicas, a CPU mesh on gloo):
``python pipeline_worker.py CONFIG_JSON RANK``.

Each stage holds its own layers: a weight sharded over the stage's two ranks (a DTensor)
and a plain tensor the two hold alike (saved once, by one of them). Saves step 1, restores
it whole and in part (``paths=["model"]``), and writes to ``<results>/rank-<RANK>.json``
the sha256 of each array of both restores and the manifest's replicas.
"""

import hashlib
from pathlib import Path

import torch
import torch.distributed as dist
from rank_worker import serve
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tiered_ckpt import CheckpointManager


def stage_state(rank: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = rank // 2
    weight = torch.arange(8, dtype=torch.float32).reshape(4, 2) + 10 * stage
    return {
        "model": {
            f"layers.{stage}.w": distribute_tensor(weight, mesh["dp"], [Shard(0)]),
            f"layers.{stage}.step": torch.tensor(float(3 + stage)),
        },
        "optim": {"lr": 0.1, "moment": torch.full((3,), float(rank))},
    }


def digests(state: dict) -> dict[str, str]:
    found = {}
    for name, value in state["model"].items():
        local = value.to_local() if hasattr(value, "to_local") else value
        found[name] = hashlib.sha256(local.contiguous().numpy().tobytes()).hexdigest()
    return found


def run(config: dict, coordinator, result: dict) -> None:
    rank = dist.get_rank()
    torch.set_num_threads(1)
    state = stage_state(rank)
    with CheckpointManager(Path(config["local_root"]) / f"rank-{rank}", coordinator=coordinator) as manager:
        manager.save(1, state, blocking=True)
        result["saved"] = digests(state)
        result["replicas"] = [list(map(list, record.replicas)) for record in manager.locate(1).shards]
        whole = manager.restore().torch_state()
        part = manager.restore(paths=["model"]).torch_state()
        result["whole"], result["part"], result["part_keys"] = digests(whole), digests(part), sorted(part)


if __name__ == "__main__":
    serve(run)
