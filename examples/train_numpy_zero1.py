"""Train a small numpy MLP with ZeRO-1 Adam over 4 simulated ranks, checkpointing with tiered_ckpt.

Run it, kill it, run it again: it resumes from the newest checkpoint in either tier.

    python examples/train_numpy_zero1.py --config configs/local.toml --steps 100

Without --config, TIERED_CKPT_LOCAL_DIR (and TIERED_CKPT_REMOTE_URL for a bucket) say
where checkpoints go. The model, its data and its optimizer are tiered_ckpt.demo's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import tiered_ckpt
from tiered_ckpt.demo import WORLD_SIZE, ZeroOneAdam, train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, help="a config file (see configs/)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    args = parser.parse_args()

    optimizer = ZeroOneAdam(world_size=WORLD_SIZE)  # rank r's slice of weights and Adam moments
    config = tiered_ckpt.load_config(args.config)
    with tiered_ckpt.CheckpointManager.from_config(config, world_size=WORLD_SIZE) as manager:
        start = 0
        if manager.latest_step() is not None:
            restored = manager.restore()  # every shard verified; each from local disk or the bucket
            optimizer.states = restored.states
            start = restored.step
            print(f"resumed from step {start}; shards from {restored.sources}")
        for step in range(start + 1, args.steps + 1):
            loss = train_step(optimizer, step)
            if step % args.every == 0:
                manager.save(step, optimizer.states)  # returns once staged; written in the background
                print(f"step {step}: loss {loss:.6f}, checkpoint saved")
        manager.wait(uploaded=True)  # the last checkpoint is in every tier before we exit
    print(f"done at step {args.steps}")


if __name__ == "__main__":
    main()
