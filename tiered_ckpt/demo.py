"""The demo: a training run cut by ``kill -9``, one node's disk lost, resumed bit for bit.

``tiered-ckpt demo`` (or ``python -m tiered_ckpt.demo``) needs no account and no network:

1. it starts an S3 server (moto) on a free loopback port, with throw-away credentials;
2. a child process trains a small MLP with Adam, its optimizer state sharded ZeRO-1
   style over 4 simulated ranks, saving asynchronously every 10 steps to local disk and
   uploading in the background;
3. after step 34 the child makes sure its last checkpoint is in the bucket and is
   killed with SIGKILL: the work since that checkpoint is lost;
4. rank 2's "node" loses its disk: every rank-2 shard file is deleted;
5. a new child resumes: ranks 0, 1, 3 from local disk, rank 2 from the bucket, all
   verified by sha256, and trains to step 60;
6. the loss curve is compared with an uninterrupted run's, bit for bit.

The model and the loop are in :mod:`tiered_ckpt.demo`'s functions ``train``; the
example ``examples/train_numpy_zero1.py`` shows the same loop on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tiered_ckpt.manager import CheckpointManager
from tiered_ckpt.options import LocalOptions, RemoteOptions

__all__ = ["WORLD_SIZE", "ZeroOneAdam", "batch", "loss_and_grad", "train_step", "train", "main"]

WORLD_SIZE = 4
DIMS = (32, 64, 8)
BATCH = 64
BUCKET = "tiered-ckpt-demo"
DEMO_KEY, DEMO_SECRET = "demo-access-key", "demo-secret-key"  # moto accepts any; nothing real


def _layer_shapes() -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []
    for fan_in, fan_out in zip(DIMS[:-1], DIMS[1:], strict=True):
        shapes += [(fan_in, fan_out), (fan_out,)]
    return shapes


def _unflatten(flat: np.ndarray) -> list[np.ndarray]:
    arrays, offset = [], 0
    for shape in _layer_shapes():
        size = int(np.prod(shape))
        arrays.append(flat[offset : offset + size].reshape(shape))
        offset += size
    return arrays


NUMEL = sum(int(np.prod(shape)) for shape in _layer_shapes())


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The training batch of ``step``: a fixed synthetic regression task, the same in every run."""
    rng = np.random.default_rng(step)
    inputs = rng.standard_normal((BATCH, DIMS[0]), dtype=np.float32)
    teacher = np.random.default_rng(0).standard_normal((DIMS[0], DIMS[-1]), dtype=np.float32)
    return inputs, np.tanh(inputs @ teacher)


def loss_and_grad(flat: np.ndarray, inputs: np.ndarray, targets: np.ndarray) -> tuple[np.float32, np.ndarray]:
    """Mean squared error of the MLP and its gradient, as one flat vector."""
    w1, b1, w2, b2 = _unflatten(flat)
    hidden = np.tanh(inputs @ w1 + b1)
    out = hidden @ w2 + b2
    diff = out - targets
    loss = np.float32(np.mean(diff * diff))
    d_out = (2.0 / diff.size) * diff
    d_hidden = (d_out @ w2.T) * (1 - hidden * hidden)
    grads = [inputs.T @ d_hidden, d_hidden.sum(0), hidden.T @ d_out, d_out.sum(0)]
    return loss, np.concatenate([g.astype(np.float32).ravel() for g in grads])


class ZeroOneAdam:
    """Adam with its state sharded ZeRO-1 style: rank r owns a contiguous slice of the
    flat fp32 master weights and of both moments, and updates only that slice."""

    def __init__(self, world_size: int = WORLD_SIZE, lr: float = 1e-2) -> None:
        self.lr = np.float32(lr)
        flat = (np.random.default_rng(1).standard_normal(NUMEL, dtype=np.float32) * 0.1).astype(np.float32)
        bounds = np.linspace(0, NUMEL, world_size + 1).astype(int)
        self.states = [
            {
                "master_fp32": flat[lo:hi].copy(),
                "exp_avg": np.zeros(hi - lo, np.float32),
                "exp_avg_sq": np.zeros(hi - lo, np.float32),
                "step": np.array(0, np.int64),
            }
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
        ]

    def params(self) -> np.ndarray:
        """The all-gathered flat parameter vector."""
        return np.concatenate([state["master_fp32"] for state in self.states])

    def step(self, grad: np.ndarray) -> None:
        """Each rank applies Adam to its own slice of the (all-reduced) gradient."""
        offset = 0
        for state in self.states:
            size = len(state["master_fp32"])
            g = grad[offset : offset + size]
            offset += size
            state["step"] += 1
            t = int(state["step"])
            state["exp_avg"] *= np.float32(0.9)
            state["exp_avg"] += np.float32(0.1) * g
            state["exp_avg_sq"] *= np.float32(0.999)
            state["exp_avg_sq"] += np.float32(0.001) * g * g
            m_hat = state["exp_avg"] / np.float32(1 - 0.9**t)
            v_hat = state["exp_avg_sq"] / np.float32(1 - 0.999**t)
            state["master_fp32"] -= self.lr * m_hat / (np.sqrt(v_hat) + np.float32(1e-8))


def train_step(optimizer: ZeroOneAdam, step: int) -> np.float32:
    """One data-parallel step: each rank's micro-batch gradient, the all-reduce (a mean), then
    each rank's Adam update of its slice. Returns the step's loss."""
    inputs, targets = batch(step)
    micro = [
        loss_and_grad(optimizer.params(), x, y)
        for x, y in zip(np.split(inputs, WORLD_SIZE), np.split(targets, WORLD_SIZE), strict=True)
    ]
    optimizer.step(np.mean([grad for _loss, grad in micro], axis=0).astype(np.float32))
    return np.float32(np.mean([loss for loss, _grad in micro]))


def train(
    total_steps: int,
    manager: CheckpointManager | None = None,
    *,
    every: int = 10,
    on_step: Any = None,
) -> dict[int, str]:
    """Train to ``total_steps``, resuming from ``manager``'s newest checkpoint if it has one.

    Saves asynchronously every ``every`` steps. Returns the loss of each step this call
    ran, as exact hex strings. ``on_step(step, loss, manager)`` runs after each step.
    """
    optimizer = ZeroOneAdam()
    start = 0
    if manager is not None and manager.latest_step() is not None:
        restored = manager.restore()
        optimizer.states = restored.states
        start = restored.step
        print(f"  resumed at step {start}; shards from: {restored.sources}", flush=True)
    losses = {}
    for step in range(start + 1, total_steps + 1):
        losses[step] = float(train_step(optimizer, step)).hex()
        if manager is not None and step % every == 0:
            manager.save(step, optimizer.states)
        if on_step is not None:
            on_step(step, losses[step], manager)
    if manager is not None:
        manager.wait(uploaded=True)
    return losses


def _child(arguments: dict[str, Any]) -> None:
    """One training process of the demo (run as ``python -m tiered_ckpt.demo --child JSON``)."""
    kill_at = arguments.get("kill_at")
    log = open(arguments["losses"], "a")  # noqa: SIM115 - kept open for the whole run, closed below

    def record_and_maybe_die(step: int, loss: str, manager: CheckpointManager | None) -> None:
        log.write(json.dumps({"step": step, "loss": loss}) + "\n")
        log.flush()  # a SIGKILL must not lose the losses already printed
        if step == kill_at and manager is not None:
            manager.wait(uploaded=True)
            print(f"  step {step}: step {manager.latest_step()} is in the bucket; SIGKILL now", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    manager = None
    if arguments.get("local_dir"):
        manager = CheckpointManager(
            LocalOptions(arguments["local_dir"], keep_last=2),
            remote=RemoteOptions(arguments["remote_url"], storage_options=arguments["storage_options"], keep_last=3),
            world_size=WORLD_SIZE,
        )
    train(arguments["steps"], manager, on_step=record_and_maybe_die)
    if manager is not None:
        manager.close()
    log.close()


def _run_child(arguments: dict[str, Any]) -> int:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "tiered_ckpt.demo", "--child", json.dumps(arguments)], env=env
    ).returncode


def _read_losses(path: Path) -> dict[int, str]:
    """Each step's loss; a step run again after a resume counts with its newest value."""
    if not path.exists():
        return {}
    return {row["step"]: row["loss"] for row in map(json.loads, path.read_text().splitlines())}


def run_demo(workdir: Path, steps: int = 60, kill_at: int = 34) -> bool:
    """Run the whole demo in ``workdir``; True if the resumed run matches the uninterrupted one."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        import boto3

        boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=DEMO_KEY,
            aws_secret_access_key=DEMO_SECRET,
            region_name="us-east-1",
        ).create_bucket(Bucket=BUCKET)
        print(f"1. embedded S3 server (moto) at {endpoint}, bucket s3://{BUCKET}")
        options = {
            "key": DEMO_KEY,
            "secret": DEMO_SECRET,
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        }
        local = workdir / "local"
        job = {"local_dir": str(local), "remote_url": f"s3://{BUCKET}/run", "storage_options": options, "steps": steps}
        resumed_losses = workdir / "losses-resumed.jsonl"
        print(f"2. training {steps} steps on 4 simulated ZeRO-1 ranks, async checkpoint every 10 steps")
        code = _run_child({**job, "losses": str(resumed_losses), "kill_at": kill_at})
        print(f"3. the training process died with signal {-code} (SIGKILL) at step {kill_at}")
        lost = sorted(local.glob("step-*/rank-00002-of-*.safetensors"))
        for path in lost:
            path.unlink()
        steps_hit = ", ".join(path.parent.name for path in lost)
        print(f"4. rank 2's node lost its disk: deleted {len(lost)} shard files ({steps_hit})")
        print("5. resuming in a new process")
        if _run_child({**job, "losses": str(resumed_losses)}) != 0:
            raise SystemExit("the resumed run failed")
        baseline_losses = workdir / "losses-uninterrupted.jsonl"
        print("6. an uninterrupted run of the same job, without checkpoints, for comparison")
        _run_child({"steps": steps, "losses": str(baseline_losses)})
        resumed, baseline = _read_losses(resumed_losses), _read_losses(baseline_losses)
        same = resumed == baseline and len(baseline) == steps
        for step in (1, 10, 30, 31, 40, 60):
            after, before = float.fromhex(resumed[step]), float.fromhex(baseline[step])
            print(f"   step {step:>2}: resumed {after:.9f}  uninterrupted {before:.9f}")
        print("   loss curves are bit-for-bit identical" if same else "   LOSS CURVES DIFFER")
        return same
    finally:
        server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tiered-ckpt demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help="working directory (default: a new temp directory)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
        return 0
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="tiered-ckpt-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"tiered-ckpt demo in {workdir}")
    return 0 if run_demo(workdir) else 1


if __name__ == "__main__":
    raise SystemExit(main())
