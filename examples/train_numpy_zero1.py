"""Train a linear model with ZeRO-1 Adam over 4 simulated ranks, checkpointing with tiered_ckpt.

Run it, kill it, run it again: it resumes from the newest checkpoint in either tier.

    python examples/train_numpy_zero1.py --config configs/local.toml --steps 100

Without --config, TIERED_CKPT_LOCAL_DIR (and TIERED_CKPT_REMOTE_URL for a bucket) say
where checkpoints go. Everything the job holds is here: rank r owns a contiguous slice of
the flat fp32 weights and of both Adam moments, and checkpoints exactly that slice.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import tiered_ckpt

WORLD_SIZE = 4
IN, OUT, BATCH = 24, 6, 32
TEACHER = np.random.default_rng(0).standard_normal((IN, OUT)).astype(np.float32)


def initial_states() -> list[dict[str, np.ndarray]]:
    """Rank r's slice of the flat weights and of Adam's moments, and its step counter."""
    flat = np.random.default_rng(1).standard_normal(IN * OUT).astype(np.float32) * 0.1
    return [
        {"weights": part.copy(), "m": np.zeros_like(part), "v": np.zeros_like(part), "t": np.array(0, np.int64)}
        for part in np.array_split(flat, WORLD_SIZE)
    ]


def train_step(states: list[dict[str, np.ndarray]], step: int, lr: float = 1e-2) -> float:
    """All-gather the weights, compute the loss and gradient of one batch, update each rank's slice."""
    x = np.random.default_rng(step).standard_normal((BATCH, IN)).astype(np.float32)
    weights = np.concatenate([state["weights"] for state in states]).reshape(IN, OUT)
    error = x @ weights - x @ TEACHER
    grad = (2.0 / error.size) * (x.T @ error).ravel()
    for state, g in zip(states, np.array_split(grad.astype(np.float32), WORLD_SIZE), strict=True):
        state["t"] += 1
        state["m"][:] = 0.9 * state["m"] + 0.1 * g
        state["v"][:] = 0.999 * state["v"] + 0.001 * g * g
        m_hat = state["m"] / (1 - 0.9 ** int(state["t"]))
        v_hat = state["v"] / (1 - 0.999 ** int(state["t"]))
        state["weights"] -= np.float32(lr) * m_hat / (np.sqrt(v_hat) + 1e-8)
    return float(np.mean(error * error))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, help="a config file (see configs/)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    args = parser.parse_args()

    states = initial_states()
    config = tiered_ckpt.load_config(args.config)
    with tiered_ckpt.CheckpointManager.from_config(config, world_size=WORLD_SIZE) as manager:
        start = 0
        if manager.latest_step() is not None:
            restored = manager.restore()  # every shard verified; each from local disk or the bucket
            states = restored.states
            start = restored.step
            print(f"resumed from step {start}; shards from {restored.sources}")
        for step in range(start + 1, args.steps + 1):
            loss = train_step(states, step)
            if step % args.every == 0:
                manager.save(step, states)  # returns once staged; written in the background
                print(f"step {step}: loss {loss:.6f}, checkpoint staged (committed in the background)")
        manager.wait(uploaded=True)  # the last checkpoint is in every tier before we exit
    print(f"done at step {args.steps}")


if __name__ == "__main__":
    main()
