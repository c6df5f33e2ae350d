"""The ``peer`` section of the benchmark: a lost node restored from its partners, and what a partner copy costs.

Four rank processes (gloo through a file store) run as two "nodes" named explicitly
(``peer.nodes``: ranks 0-1 on node a, 2-3 on node b), each rank with a directory of its
own and each node a memory folder of its own (``peer.memory_dir``), all under the
scratch root (so nothing is left in ``/dev/shm``). Two parts, each in interleaved rounds:

1. *Node recovery*: a state of ``--size-gib`` split over the ranks is saved to disk, to
   the partners' memory and to a bucket (moto's S3 server on loopback, as it answers, and
   through the bucket model of ``bucket_model.py``: S3's limits), and the same step
   is then restored by freshly started processes three ways, in an order that rotates
   from round to round: nothing lost (every rank from its own disk); node a lost (its
   ranks' directories and its memory folder deleted) with the peer tier on, so its shards
   come from node b's memory; node a lost with the peer tier off, so they come from the
   bucket. Every shard file on the disks is evicted from the page cache before each
   restore (cold); the partners' memory and moto's objects are in RAM. Each rank times its
   restore from a barrier before ``restore()`` to a barrier after it; the figure is the
   slowest of node a's ranks. A restore from the partners returns before the lost disks
   are refilled (the refill runs on the writer's thread after it): the time until that
   refill is durable (``manager.wait()``, then a barrier) is shown beside it.
2. *The cost of a copy*: in one running job, a save of the same state to disk
   (``local.every=1``, no peer tier) and a partner copy of a step kept in memory only
   (``local.every`` never reached, ``peer.every=1``), in alternating order: the save
   call's stall (``blocking=False``) and the time until the step is committed
   (``handle.committed``), each the slowest rank's, and the CPU time of the four
   processes. Then the ``train`` section's loop (numpy matmuls, AdamW-like updates),
   data-parallel over the four ranks (each a quarter of the batch and of the optimizer
   state, a barrier a step, one BLAS thread a rank), without copies and with a partner
   copy every 10 steps (``peer.every=10``), interleaved.

With four rank processes on a machine of two cores no core is free for the copies: next
to the measured slowdown the section prints the floor the copies' share of the CPU
implies (their CPU seconds over the loop's) and what the save calls' stall alone costs
(the slowdown where a core is free for the copy's background work). A rank process is
``python -m benchmarks.peer CONFIG RANK``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import (
    Target,
    evict,
    make_rank_state,
    modelled_bucket,
    moto_server,
    run_rank_processes,
    show_ratio,
)
from tiered_ckpt.manager import CheckpointManager, SaveHandle
from tiered_ckpt.options import LocalOptions, PeerOptions, RemoteOptions

__all__ = ["bench_peer", "rank_process"]

NODES = ("a", "a", "b", "b")  # the node of each rank
LOST = "a"
LOST_RANKS = tuple(rank for rank, node in enumerate(NODES) if node == LOST)
COPY_EVERY = 10  # the training loop's partner copies: every 10th step
NEVER = 10**12  # a local.every no step of the section reaches
TRAIN_DIM, TRAIN_LAYERS, TRAIN_BATCH = 1024, 3, 512  # the train section's loop
BUCKET = "tiered-peer-bench"
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
COMMAND = [sys.executable, "-m", "benchmarks.peer"]

# (label, node a lost?, peer tier on?, the tier node a's shards must come from)
RESTORES = (
    ("own disk (nothing lost)", False, True, "local"),
    ("partners' memory (node a lost)", True, True, "peer"),
    ("bucket (node a lost, peer tier off)", True, False, "remote"),
)
SAVES = ("disk save", "partner copy")
REFILLED = "partners' memory, until the disk is refilled"


def bench_peer(
    total_bytes: int, root: Path, repeat: int, steps: int, model_module: str, buckets: Sequence[str] = ("moto",)
) -> list[Target]:
    """Print the section's figures (see the module doc); ``steps``: the training loop's length.
    Node recovery runs once a bucket of ``buckets``: moto as it answers (``"moto"``), and
    through the bucket model that ``model_module`` serves (``"model"``). Returns the partner /
    bucket restore speed-ups as issue 45's item 2 rows."""
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        print("  skipped: needs torch (pip install 'tiered-ckpt[torch]')")
        return []
    targets = []
    directory = root / "peer"
    directory.mkdir()
    try:
        print(
            f"  state {total_bytes / 2**30:.2f} GiB over 4 ranks (a quarter each); node a: ranks 0-1, node b: 2-3; "
            f"memory folders under the scratch root ({_file_system(directory)}), cpus={os.cpu_count()}"
        )
        try:
            import boto3  # noqa: F401
            import moto  # noqa: F401
        except ImportError:
            print("  node recovery skipped: needs boto3 and moto (pip install -e '.[bench]')")
            restores = {}
        else:
            restores = {
                kind: _recovery(total_bytes, directory / f"recovery-{kind}", repeat, kind, model_module)
                for kind in buckets
            }
        report = _costs(total_bytes, directory / "costs", repeat, steps)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        os.sync()
    for kind, seconds in restores.items():
        print(
            "  restore of one step by freshly started processes, node a's ranks, barrier to barrier (disks cold), "
            + _BUCKETS[kind]
            + ":"
        )
        for label in [label for label, *_ in RESTORES] + [REFILLED]:
            _print_seconds(f"    {label}", seconds[label])
    print("  one save of the whole state, the slowest rank's (CPU: the 4 processes'):")
    for name in SAVES:
        _print_seconds(f"    {name}: save call (stall)", [r[name]["stall"] for r in report["saves"]], milli=True)
        _print_seconds(f"    {name}: until committed", [r[name]["committed"] for r in report["saves"]], milli=True)
        _print_seconds(f"    {name}: CPU time", [r[name]["cpu"] for r in report["saves"]], milli=True)
    loop = _loop_figures(report, steps)
    print(
        f"  training loop (the train section's, data-parallel over 4 ranks): "
        f"{loop['state'] / 2**20:.0f} MiB of state, {steps} steps of {loop['step'] * 1e3:.0f} ms, "
        f"{loop['copies']} partner copies"
    )
    _print_seconds("    without copies", loop["plain"])
    _print_seconds(f"    partner copy every {COPY_EVERY} steps", loop["copying"])
    print(
        f"    the loop's CPU {loop['step_cpu'] * 1e3:.0f} ms a step (cores {100 * loop['busy']:.0f} % busy), "
        f"a copy's {loop['copy_cpu'] * 1e3:.0f} ms (the 4 processes'), its save call {loop['stall'] * 1e3:.1f} ms"
    )
    print("ratios (target):")
    for kind, seconds in restores.items():
        disk, partner, bucket = (seconds[label] for label, *_ in RESTORES)
        speedup = statistics.median(b / p for b, p in zip(bucket, partner, strict=True))
        show_ratio(f"lost node: partner / bucket (restore speed-up), {kind}", speedup, ">= 10x")
        targets.append(Target(2, f"lost node: partner / bucket restore speed-up, {kind}", speedup, 10.0))
        slower = statistics.median(p / d for p, d in zip(partner, disk, strict=True))
        show_ratio(f"lost node: partner / own disk, {kind}", slower, "<= 1.0x time")
    stalls = [r["partner copy"]["stall"] / r["disk save"]["stall"] for r in report["saves"]]
    show_ratio("partner copy stall / disk save stall", statistics.median(stalls), "<= 1.0")
    costs = [r["partner copy"]["committed"] / r["disk save"]["committed"] for r in report["saves"]]
    show_ratio("partner copy / disk save (until committed)", statistics.median(costs), "no target: see below")
    free = (os.cpu_count() or 1) > len(NODES)
    where = "a core free" if free else f"no core free here: 4 ranks on {os.cpu_count()} cores"
    met = "met" if loop["slowdown"] < 0.02 else "not met"
    _print_percent(f"partner copy every {COPY_EVERY} steps: slowdown", loop["slowdown"], f"< 2 %, {met}; {where}")
    _print_percent("  floor of its CPU share, no core free", loop["floor"], "copy CPU / loop CPU: all cores busy")
    _print_percent("  its save calls' stall alone (a core free)", loop["free"], "< 2 %")
    return targets


def _print_seconds(label: str, values: Sequence[float], *, milli: bool = False) -> None:
    scale, unit = (1e3, "ms") if milli else (1.0, "s")
    median = statistics.median(values) * scale
    print(f"{label:<50} {median:8.2f} {unit:<2}  (min {min(values) * scale:.2f}, max {max(values) * scale:.2f})")


def _print_percent(label: str, value: float, target: str) -> None:
    print(f"  {label:<46} {100 * value:5.1f} %  ({target})")


def _file_system(path: Path) -> str:
    """The type of the file system holding ``path`` (from /proc/mounts; "unknown" without it)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return "unknown"
    where, best = str(path.resolve()) + "/", ("", "unknown")
    for line in mounts:
        fields = line.split()
        if len(fields) > 2 and where.startswith(fields[1].rstrip("/") + "/") and len(fields[1]) >= len(best[0]):
            best = (fields[1], fields[2])
    return best[1]


# -- the parent's side -------------------------------------------------------------------


def _launcher(root: Path, **shared: Any) -> Callable[..., list[dict[str, Any]]]:
    """A function starting the 4 rank processes once more under ``root`` (a directory a launch)
    for one action; it returns every rank's report, by rank."""
    launches = itertools.count()

    def launch(do: str, **settings: Any) -> list[dict[str, Any]]:
        where = root / f"launch-{next(launches)}"
        reports = run_rank_processes(COMMAND, where, len(NODES), "peer", ONE_THREAD, do=do, **shared, **settings)
        return list(reports)

    return launch


_BUCKETS = {"moto": "bucket: moto as it answers", "model": "bucket: the bucket model"}


def _recovery(total_bytes: int, root: Path, repeat: int, kind: str, model_module: str) -> dict[str, list[float]]:
    """Part 1 (see the module doc): the seconds of each restore, by label, a value a round, with
    the bucket of ``kind``."""
    root.mkdir()
    seconds: dict[str, list[float]] = {label: [] for label, *_ in RESTORES} | {REFILLED: []}
    with contextlib.ExitStack() as stack:
        endpoint, client, options = stack.enter_context(moto_server())
        if kind == "model":
            model = stack.enter_context(modelled_bucket(endpoint, model_module))
            client, options = model.client, model.options
        client.create_bucket(Bucket=BUCKET)
        launch = _launcher(root, total_bytes=total_bytes, url=f"s3://{BUCKET}/run", options=options)
        for report in launch("save"):
            if report["peer_error"] is not None or report["peer_steps"] != [1] or report["remote_steps"] != [1]:
                raise RuntimeError(f"peer benchmark: the save did not reach every tier: {report}")
        for run in range(repeat):
            for label, lose, peer, expected in RESTORES[run % 3 :] + RESTORES[: run % 3]:
                if lose:
                    for rank in LOST_RANKS:
                        shutil.rmtree(root / "disks" / f"rank-{rank}")
                    shutil.rmtree(root / f"memory-{LOST}", ignore_errors=True)
                evict([path for path in (root / "disks").rglob("*") if path.is_file()])
                reports = launch("restore", peer=peer)
                for rank, report in enumerate(reports):
                    source = expected if rank in LOST_RANKS else "local"
                    if report["step"] != 1 or report["sources"] != {str(rank): source}:
                        raise RuntimeError(f"peer benchmark, {label}: rank {rank} restored {report}, not from {source}")
                seconds[label].append(max(reports[rank]["seconds"] for rank in LOST_RANKS))
                if lose and peer:
                    seconds[REFILLED].append(max(reports[rank]["refilled"] for rank in LOST_RANKS))
    return seconds


def _costs(total_bytes: int, root: Path, repeat: int, steps: int) -> dict[str, Any]:
    """Part 2 (see the module doc): rank 0's view of each round, with every rank's figures folded in."""
    root.mkdir()
    reports = _launcher(root, total_bytes=total_bytes, repeat=repeat, steps=steps)("costs")
    saves = [
        {
            name: {
                "stall": max(report["saves"][run][name]["stall"] for report in reports),
                "committed": max(report["saves"][run][name]["committed"] for report in reports),
                "cpu": sum(report["saves"][run][name]["cpu"] for report in reports),
            }
            for name in SAVES
        }
        for run in range(repeat)
    ]
    loops = [
        {
            "copying": run["copying"],
            "wall": run["wall"],  # the same on every rank: a barrier at either end
            "cpu": sum(report["loops"][index]["cpu"] for report in reports),
            "blocked": max(report["loops"][index]["blocked"] for report in reports),
            "copies": run["copies"],
        }
        for index, run in enumerate(reports[0]["loops"])
    ]
    copy_cpu = [sum(report["copy_cpu"][index] for report in reports) for index in range(len(reports[0]["copy_cpu"]))]
    return {"saves": saves, "loops": loops, "copy_cpu": copy_cpu, "state": reports[0]["loop_state"]}


def _loop_figures(report: dict[str, Any], steps: int) -> dict[str, Any]:
    """The training loop's figures: walls, the measured slowdown (the median of each round's),
    the floor the copies' CPU share implies, and the slowdown of the save calls' stall alone."""
    plain = [loop for loop in report["loops"] if not loop["copying"]]
    copying = [loop for loop in report["loops"] if loop["copying"]]
    step = statistics.median(loop["wall"] for loop in plain) / steps
    step_cpu = statistics.median(loop["cpu"] for loop in plain) / steps
    copies = copying[0]["copies"]
    stall = statistics.median(loop["blocked"] / max(loop["copies"], 1) for loop in copying)
    copy_cpu = statistics.median(report["copy_cpu"])
    return {
        "plain": [loop["wall"] for loop in plain],
        "copying": [loop["wall"] for loop in copying],
        "slowdown": statistics.median(c["wall"] / p["wall"] for p, c in zip(plain, copying, strict=True)) - 1,
        "floor": copy_cpu / (COPY_EVERY * step_cpu),
        "free": stall / (COPY_EVERY * step),
        "step": step,
        "step_cpu": step_cpu,
        "busy": step_cpu / (step * (os.cpu_count() or 1)),
        "copy_cpu": copy_cpu,
        "stall": stall,
        "copies": copies,
        "state": report["state"],
    }


# -- the rank processes' side ----------------------------------------------------------------


def _manager(
    local: Path,
    memory: Path | None,
    *,
    local_every: int = 1,
    peer_every: int = 1,
    remote: tuple[str, dict[str, Any]] | None = None,
) -> CheckpointManager:
    """This rank's manager: a disk at ``local``, the peer tier if ``memory`` (this node's memory
    folder) is given, and the bucket if ``remote`` is (url, storage options)."""
    from tiered_ckpt.dist.coordination import TorchDistributedCoordinator

    return CheckpointManager(
        LocalOptions(local, keep_last=None, every=local_every),  # None: no deletion inside a timed save
        remote=RemoteOptions(remote[0], storage_options=remote[1]) if remote is not None else None,
        peer=PeerOptions(nodes=NODES, memory_dir=memory, every=peer_every) if memory is not None else None,
        coordinator=TorchDistributedCoordinator(),
    )


def _save(config: dict[str, Any], rank: int, job: Any) -> dict[str, Any]:
    """Part 1's save: step 1 to every tier, waited for in each."""
    root = Path(config["root"]).parent
    state = make_rank_state(config["total_bytes"], len(NODES), rank)
    remote = (config["url"], config["options"])
    with _manager(root / "disks" / f"rank-{rank}", root / f"memory-{NODES[rank]}", remote=remote) as manager:
        manager.save(1, state, blocking=True)
        manager.wait(uploaded=True)
        replicator = manager._parts.peer
        if replicator is None:
            raise RuntimeError("peer benchmark: the peer tier is off")
        replicator.wait()
        return {
            "peer_error": replicator.last_error,
            "peer_steps": replicator.target.steps(),
            "remote_steps": manager.remote_steps(),
        }


def _restore(config: dict[str, Any], rank: int, job: Any) -> dict[str, Any]:
    """Part 1's restore, timed from a barrier before it to a barrier after it."""
    root = Path(config["root"]).parent
    memory = root / f"memory-{NODES[rank]}" if config["peer"] else None
    remote = (config["url"], config["options"])
    with _manager(root / "disks" / f"rank-{rank}", memory, remote=remote) as manager:
        job.barrier()
        start = time.perf_counter()
        restored = manager.restore()
        job.barrier()
        seconds = time.perf_counter() - start
        manager.wait()  # the refill of a lost node's disk runs after restore() returned
        job.barrier()
        refilled = time.perf_counter() - start
    sources = {str(old): tier for old, tier in restored.sources.items()}
    return {"seconds": seconds, "refilled": refilled, "step": restored.step, "sources": sources}


def _timed_save(job: Any, manager: CheckpointManager, step: int, state: dict[str, Any]) -> dict[str, float]:
    """One save from a barrier: its call's seconds (the stall), the seconds until it is committed
    and this process's CPU seconds until then."""
    job.barrier()
    cpu, start = time.process_time(), time.perf_counter()
    handle = manager.save(step, state)
    stall = time.perf_counter() - start
    if handle.committed.result() is None:
        raise RuntimeError(f"peer benchmark: step {step} went to no tier")
    committed = time.perf_counter() - start
    return {"stall": stall, "committed": committed, "cpu": time.process_time() - cpu}


def _costs_rank(config: dict[str, Any], rank: int, job: Any) -> dict[str, Any]:
    """Part 2 on one rank: the saves, then the training loop's rounds, then copies of its state alone."""
    import torch.distributed as dist

    root, repeat, steps = Path(config["root"]), config["repeat"], config["steps"]
    memory = root / f"memory-{NODES[rank]}"
    state = make_rank_state(config["total_bytes"], len(NODES), rank)
    disk = _manager(root / "disk" / f"rank-{rank}", None)
    copy = _manager(root / "copy" / f"rank-{rank}", memory, local_every=NEVER)
    with disk, copy:
        managers = {"disk save": disk, "partner copy": copy}
        for manager in managers.values():  # untimed: allocates the staging buffers and the partners' slots
            _timed_save(job, manager, 1, state)
        saves = []
        for run in range(repeat):
            names = SAVES[run % 2 :] + SAVES[: run % 2]
            saves.append({name: _timed_save(job, managers[name], run + 2, state) for name in names})
    del state
    span = -(-steps // COPY_EVERY) * COPY_EVERY  # the steps of a round, rounded up to the copies' cadence
    loops: list[dict[str, Any]] = []
    with _manager(root / "train" / f"rank-{rank}", memory, local_every=NEVER, peer_every=COPY_EVERY) as trained:
        for run in range(repeat):
            for copying in (False, True) if run % 2 == 0 else (True, False):
                loop = _train(rank, steps, run * span, trained if copying else None, dist.barrier, job)
                loops.append({"copying": copying, **loop})
        last = repeat * span
        loop_state = _loop_state(rank)
        copy_cpu = [_timed_save(job, trained, last + COPY_EVERY * (n + 1), loop_state)["cpu"] for n in range(repeat)]
    loop_bytes = sum(array.nbytes for array in loop_state.values()) * len(NODES)
    return {"saves": saves, "loops": loops, "copy_cpu": copy_cpu, "loop_state": loop_bytes}


def _loop_state(rank: int) -> dict[str, np.ndarray]:
    """The shape of what a rank of the training loop saves: its quarter of the fp32 master
    weights and of the two moments."""
    part = _part(rank)
    size = part.stop - part.start
    rng = np.random.default_rng(rank)
    return {
        "master_fp32": rng.standard_normal(size, dtype=np.float32),
        "exp_avg": rng.standard_normal(size, dtype=np.float32),
        "exp_avg_sq": rng.random(size, dtype=np.float32),
        "step": np.array(0, dtype=np.int64),
    }


def _part(rank: int) -> slice:
    """This rank's quarter of the parameters (ZeRO-1-like)."""
    bounds = np.linspace(0, TRAIN_DIM * TRAIN_DIM * TRAIN_LAYERS, len(NODES) + 1).astype(int)
    return slice(int(bounds[rank]), int(bounds[rank + 1]))


def _train(
    rank: int, steps: int, offset: int, manager: CheckpointManager | None, sync: Callable[[], object], job: Any
) -> dict[str, Any]:
    """The train section's loop, this rank's quarter of it: a quarter of the batch, the updates
    of a quarter of the parameters, a barrier a step (the gradients' all-reduce would be one),
    and with ``manager`` a save at every step (its cadence takes every ``COPY_EVERY``-th).
    Returns the loop's wall time (barrier to barrier), this process's CPU time, the seconds
    the save calls took and the copies made."""
    rng = np.random.default_rng(0)
    dim, layers, batch = TRAIN_DIM, TRAIN_LAYERS, TRAIN_BATCH // len(NODES)
    master = rng.standard_normal(dim * dim * layers, dtype=np.float32) * 0.01  # the same on every rank
    part = _part(rank)
    exp_avg = np.zeros(part.stop - part.start, dtype=np.float32)
    exp_avg_sq = np.zeros_like(exp_avg)
    weights = master.reshape(layers, dim, dim)
    inputs = np.random.default_rng(1 + rank).standard_normal((batch, dim), dtype=np.float32)
    handles: list[SaveHandle] = []
    blocked = 0.0
    job.barrier()
    cpu, start = time.process_time(), time.perf_counter()
    for step in range(offset + 1, offset + steps + 1):
        hidden = inputs
        for layer in range(layers):
            hidden = np.tanh(hidden @ weights[layer])
        grad = np.concatenate([(inputs.T @ hidden).ravel() * 1e-6 for _ in range(layers)])[part]
        exp_avg *= 0.9
        exp_avg += 0.1 * grad
        exp_avg_sq *= 0.999
        exp_avg_sq += 0.001 * grad * grad
        master[part] -= 1e-3 * exp_avg / (np.sqrt(exp_avg_sq) + 1e-8)
        sync()
        if manager is not None:
            called = time.perf_counter()
            state = {
                "master_fp32": master[part],
                "exp_avg": exp_avg,
                "exp_avg_sq": exp_avg_sq,
                "step": np.array(step, dtype=np.int64),
            }
            handle = manager.save(step, state)
            blocked += time.perf_counter() - called
            if step % COPY_EVERY == 0:
                handles.append(handle)
    for handle in handles:  # the last copies are part of the loop's time
        if handle.committed.result() is None:
            raise RuntimeError(f"peer benchmark: the training loop's step {handle.step} went to no tier")
    job.barrier()
    wall = time.perf_counter() - start
    return {"wall": wall, "cpu": time.process_time() - cpu, "blocked": blocked, "copies": len(handles)}


ACTIONS: dict[str, Callable[[dict[str, Any], int, Any], dict[str, Any]]] = {
    "save": _save,
    "restore": _restore,
    "costs": _costs_rank,
}


def rank_process(config_path: Path, rank: int) -> None:
    """One rank process of the ``peer`` section: join the job, run the config's action, and
    (rank 0) write every rank's report."""
    import torch.distributed as dist

    from tiered_ckpt.dist.coordination import TorchDistributedCoordinator

    config = json.loads(config_path.read_text())
    timeout = timedelta(seconds=900)  # a rank that died fails the others after this, rather than hanging them
    store = f"file://{config['store']}"
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=config["processes"], timeout=timeout)
    job = TorchDistributedCoordinator(timeout=timeout)  # the section's own barriers and gathers
    reports = job.all_gather(ACTIONS[config["do"]](config, rank, job))
    if rank == 0:
        Path(config["results"]).write_text(json.dumps(reports))
    dist.destroy_process_group()


if __name__ == "__main__":
    rank_process(Path(sys.argv[1]), int(sys.argv[2]))
