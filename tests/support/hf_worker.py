"""One rank of a transformers training job under FSDP2: ``python hf_worker.py CONFIG_JSON RANK``.

Builds a small ``LlamaForCausalLM`` from a config (no download), shards it with
``fully_shard`` on a CPU mesh, trains it a few steps on random tokens and saves
``{"model": ..., "optim": ...}`` (``get_state_dict``: DTensors) through the manager, to the
bucket too when the config names one. Rank 0 also writes the gathered parameters
(``full_tensor()`` of each) to ``<results>/gathered.safetensors`` and the model's
``config.json`` to ``<results>/hf``, for the test to compare an export with.
"""

from pathlib import Path

import torch
import torch.distributed as dist
from rank_worker import serve
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from tiered_ckpt import CheckpointManager, RemoteOptions

CONFIG = LlamaConfig(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip


def run(config: dict, coordinator, result: dict) -> None:
    rank, world_size = dist.get_rank(), config["world_size"]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(3):
        tokens = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(step))
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model_state, optim_state = get_state_dict(model, optimizer)
    url = config.get("url")
    remote = RemoteOptions(url, storage_options=config.get("options") or {}) if url else None
    directory = Path(config["local_root"]) / f"rank-{rank}"
    with CheckpointManager(directory, coordinator=coordinator, remote=remote) as manager:
        manager.save(3, {"model": model_state, "optim": optim_state, "epoch": 1}, blocking=True)
        manager.wait(uploaded=True)
    gathered = {name: value.full_tensor().contiguous() for name, value in model_state.items()}
    results = Path(config["results"])
    if rank == 0:
        save_file(gathered, str(results / "gathered.safetensors"))
        CONFIG.save_pretrained(str(results / "hf"))


if __name__ == "__main__":
    serve(run)
