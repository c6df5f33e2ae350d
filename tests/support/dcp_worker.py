"""One rank of a ``torch.distributed.checkpoint`` test job: ``python dcp_worker.py CONFIG_JSON RANK``.

Joins a gloo job through a file store, opens a CheckpointManager on
``<local_root>/rank-<RANK>`` (its own disk; the bucket if the config names one) and runs
the config's actions with one TieredWriter reused for every save: {"do": "save", "step":
S} saves :func:`train_state` through ``dcp.save(..., checkpoint_id=S)`` ({"do":
"async_save_process", "step": S} through DCP's process-based ``async_save``; "save_as_0_2"
writes the layout 0.2's TieredWriter wrote, "load_0_2" loads it); {"do": "load",
"id": ID, "as": LABEL} loads into a fresh template through a new TieredReader
(``checkpoint_id=ID``; none if ID is null). Writes to ``<results>/rank-<RANK>.json`` the
digests of every state saved ("saved": {S: ...}) and loaded ("loaded": {LABEL: ...}), and
the steps the bucket has committed at the end ("remote_steps"). A
CheckpointError (or DCP's CheckpointException wrapping one) is recorded as "error". The
manager is not closed: with uploads held back, closing would wait for them.
"""

import hashlib
import io
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tiered_ckpt import CheckpointError, CheckpointManager, RemoteOptions, TorchDistributedCoordinator, UploadOptions


def train_state(step: int, rank: int) -> dict:
    """A small module and its AdamW state after a step of training (the same on every rank,
    as with DDP), and train-loop values: one of each rank's own, bytes, a BytesIO, a numpy
    array, a complex buffer."""
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).square().sum().backward()
    optimizer.step()
    return {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "extra": {
            "step": step,
            "rank_note": f"rank {rank} at step {step}".encode(),
            "train_state": io.BytesIO(json.dumps({"step": step}).encode()),
            "positions": np.arange(step, dtype=np.int32),
            "rope": torch.polar(torch.ones(3, 2), torch.arange(6.0).reshape(3, 2) * step),
        },
    }


def template() -> dict:
    """A state of the same keys with other values, for a load to replace."""
    state = train_state(1, -1)
    for tensor in (*state["model"].values(), *(v for s in state["optim"]["state"].values() for v in s.values())):
        tensor.zero_()
    state["extra"].update(step=0, rank_note=b"", train_state=io.BytesIO(), positions=np.zeros(0, dtype=np.int32))
    state["extra"]["rope"] = torch.zeros(3, 2, dtype=torch.complex64)
    return state


def digests(state) -> dict[str, str]:
    """Every leaf of a nested state: its type and the sha256 of its bytes (its repr for a scalar)."""
    found = {}

    def walk(value, path):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}/{key}")
        elif isinstance(value, (list, tuple)) and not all(isinstance(v, (int, float)) for v in value):
            for index, item in enumerate(value):
                walk(item, f"{path}/{index}")
        elif isinstance(value, torch.Tensor):
            data = torch.view_as_real(value) if value.is_complex() else value
            found[path] = f"{value.dtype} {tuple(value.shape)} {hashlib.sha256(data.numpy().tobytes()).hexdigest()}"
        elif isinstance(value, (bytes, io.BytesIO, np.ndarray)):
            data = value.getvalue() if isinstance(value, io.BytesIO) else value
            raw = data.tobytes() if isinstance(data, np.ndarray) else data
            found[path] = f"{type(value).__name__} {getattr(value, 'dtype', '')} {hashlib.sha256(raw).hexdigest()}"
        else:
            found[path] = repr(value)

    walk(state, "")
    return found


def run(config: dict, rank: int, result: dict) -> None:
    import torch.distributed.checkpoint as dcp

    from tiered_ckpt.torch import TieredReader, TieredWriter

    manager = CheckpointManager(
        Path(config["local_root"]) / f"rank-{rank}",
        coordinator=TorchDistributedCoordinator(),
        remote=RemoteOptions(config["url"], storage_options=config.get("options") or {}) if config.get("url") else None,
        upload=UploadOptions(max_tries=1),
    )
    writer = TieredWriter(manager)
    result["saved"], result["loaded"] = {}, {}
    for action in config["actions"]:
        if action["do"] == "save_as_0_2":  # the layout 0.2's TieredWriter wrote: values on rank 0 only
            from tiered_ckpt.format.state import ChunkOf

            tensors = {"w": {"0": ChunkOf(torch.arange(4.0) + rank * 4, (8,), (rank * 4,))}}
            objects = {"epoch": action["step"]} if rank == 0 else {}
            manager.save(action["step"], {"dcp": {"tensors": tensors, "objects": objects}}, blocking=True)
            manager.wait(uploaded=True)
        elif action["do"] == "load_0_2":
            state = {"w": torch.zeros(8), "epoch": 0}
            dcp.load(state, storage_reader=TieredReader(manager), checkpoint_id=action["id"])
            result["loaded"][action["as"]] = {"w": state["w"].tolist(), "epoch": state["epoch"]}
        elif action["do"] == "async_save_process":
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            state = train_state(action["step"], rank)
            future = dcp.async_save(
                state,
                storage_writer=writer,
                checkpoint_id=action["step"],
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            )
            future.result()
        elif action["do"] == "save":
            state = train_state(action["step"], rank)
            result["saved"][str(action["step"])] = digests(state)
            dcp.save(state, storage_writer=writer, checkpoint_id=action["step"])
        else:
            state = template()
            dcp.load(state, storage_reader=TieredReader(manager), checkpoint_id=action["id"])
            result["loaded"][action["as"]] = digests(state)
    result["remote_steps"] = manager.remote_steps()


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    rank = int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{config['store']}",
        rank=rank,
        world_size=config["world_size"],
        timeout=timedelta(seconds=60),
    )
    result: dict = {"rank": rank}
    try:
        run(config, rank, result)
    except BaseException as exc:  # DCP wraps a rank's error in its CheckpointException (a BaseException)
        if not isinstance(exc, CheckpointError) and type(exc).__name__ != "CheckpointException":
            raise
        result["error"] = [type(exc).__name__, str(exc)]
    (Path(config["results"]) / f"rank-{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
