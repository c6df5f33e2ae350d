"""In a fresh process (``python -m tests.support.cuda_restore_peak DIR STATE_BYTES BUDGET``): a
state of 8 CUDA tensors saved, then restored into 8 other CUDA tensors (``into=``); prints what
the restore added to the peak resident memory (``VmHWM``, reset first) and whether the
tensors came back bit for bit. Needs CUDA."""

import json
import sys

import torch

from benchmarks.memory import _reset_peak, _status
from tiered_ckpt import CheckpointManager, RuntimeOptions


def main(directory: str, state_bytes: int, budget: int) -> dict:
    size = state_bytes // 8 // 4
    generator = torch.Generator(device="cuda").manual_seed(0)
    state = {f"layer{i}": torch.randn(size, device="cuda", generator=generator) for i in range(8)}
    into = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    with CheckpointManager(directory, world_size=1, runtime=RuntimeOptions(host_memory_bytes=budget)) as manager:
        manager.save(1, state, blocking=True)
        torch.cuda.synchronize()
        before = _reset_peak()
        result = manager.restore(into=into)
        peak = _status("VmHWM") - before
    exact = all(torch.equal(into[name], tensor) and result.state[name] is into[name] for name, tensor in state.items())
    return {"restore_peak": peak, "exact": exact}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
