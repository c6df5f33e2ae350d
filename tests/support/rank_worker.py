"""One rank of a multi-process test job: ``python rank_worker.py CONFIG_JSON RANK``.

Joins a gloo job through a file store (no ports to pick), opens a CheckpointManager on
``<local_root>/rank-<RANK>`` (``<local_root>/shared`` with "shared_dir") with a
TorchDistributedCoordinator (with "config_file", as that config and this process's
``TIERED_CKPT_*`` variables describe it, on ``<local_root>/rank-<RANK>``), runs the
config's actions in order, and writes what happened to ``<results>/rank-<RANK>.json``.
A CheckpointError ends the actions and is recorded as ``error``: [class name, message].
With "subgroup": [ranks], only those ranks take part, through a coordinator on that
process group (ranks renumbered in it).

Actions: {"do": "save", "step": S, "step_by_rank": {R: S}, "state_of": T, "text_on_rank": R} (T: the
state of another step, as a stale save holds it; R adds
an array of text; "long_note_on_rank": R, a string whose shard header no reader accepts;
"float64_on_rank": R, its flat slice "params" in float64; "metrics_by_rank": {R: {name: value}}, the
metrics rank R passes; "replicated_on_ranks": [R...], the ranks that save with replicated=True),
{"do": "steps"} (records the local steps as "steps"), {"do": "wait"} (until
uploaded), {"do": "drain_uploads", "rank": R} (rank R waits for its uploader without
raising its errors), {"do": "restore",
"reshard": bool, "count_manifest_reads": bool} (records the steps of the bucket's manifests it read as
"manifest_reads"), {"do": "restore_if_any"} (records None), {"do": "collectives"} (records the errors of
collectives one rank fails: "agree_error", "decide_error", "foreign_error"), and
{"do": "kill", "rank": R, "at": POINT} which makes rank R SIGKILL itself during its
next save at POINT: "after-shard" (its shard is durable, the commit not agreed) or
"before-commit" (every shard is durable, its own manifest not yet written).
{"do": "train", "steps": N, "signal_rank": R, "signal_at": S} runs steps 1..N asking
reached_preemption at each (rank R sends itself SIGUSR1, the manager's preemption signal,
at step S), and on True saves that step, waits for its upload and records it as
"preempted_at". {"do": "ask_preemption", "step": S, "step_by_rank": {R: S}} asks once. {"do": "count_rounds", "step": S}
saves S blocking and appends to "rounds" the backend collectives it took; {"do": "long_payloads"} gathers
strings longer than a first round carries and records [equal, rounds] for each.
{"do": "signal", "path": P} creates the file ``P-<RANK>``; {"do": "await", "path": P} waits (at most
two minutes) until the file ``P`` exists; {"do": "saves", "steps": [S...]} saves each step blocking;
{"do": "await_retrying"} waits (at most two minutes) until the manager's lag shows a step being
retried and records it as "retrying": [step, tries]; {"do": "await_queued", "at_most": N} waits
(at most "guard_seconds", default two minutes) until its uploader holds at most N steps and
records them as "queued". Config "stale_saves" is runtime.stale_saves, "upload" holds UploadOptions fields
(default: max_tries 1), "max_awaiting_upload" the local tier's; "state": "lora" saves (and
"restore" reports) :func:`lora_state` instead of :func:`rank_state`. Config "keep_best": [K, METRIC, MODE]
is the local tier's keep-best retention (with "keep_last").
"""

import hashlib
import json
import os
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tiered_ckpt import (
    CheckpointError,
    CheckpointManager,
    InvalidStateError,
    LocalOptions,
    RemoteOptions,
    RuntimeOptions,
    TorchDistributedCoordinator,
    UploadOptions,
)
from tiered_ckpt.dist.coordination import gather, leader_decides, to_payload
from tiered_ckpt.engine import writer
from tiered_ckpt.tiers import local
from tiered_ckpt.tiers.remote.tier import RemoteTier

TOTAL_NUMEL = 1003


def slice_bounds(total: int, world_size: int, rank: int) -> tuple[int, int]:
    """The flat-parameter slice of ``rank``: the first ``total % world_size`` ranks get one more."""
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def rank_state(step: int, world_size: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s model and optimizer state at ``step``: fp32 and bf16 flat slices, a replicated fp16 table."""
    flat = np.random.default_rng(step).standard_normal(TOTAL_NUMEL).astype(np.float32)
    start, end = slice_bounds(TOTAL_NUMEL, world_size, rank)
    params = torch.from_numpy(flat[start:end].copy())
    return {
        "params": params,
        "exp_avg": (params * 0.5).to(torch.bfloat16),
        "schedule": torch.arange(6, dtype=torch.float16).reshape(2, 3) * step,
    }


def lora_state(step: int, world_size: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s state of a LoRA run at ``step``: its part of a frozen bf16 base (the same at
    every step), an fp32 adapter and its Adam moments that change at every step."""
    base = torch.Generator().manual_seed(1000 + rank)
    changing = torch.Generator().manual_seed(step * world_size + rank)
    return {
        "base.q": torch.randn(128, 64, generator=base).to(torch.bfloat16),
        "base.v": torch.randn(128, 64, generator=base).to(torch.bfloat16),
        "lora.a": torch.randn(64, 8, generator=changing),
        "lora.b": torch.randn(8, 64, generator=changing),
        "exp_avg.a": torch.rand(64, 8, generator=changing),
        "exp_avg_sq.a": torch.rand(64, 8, generator=changing),
    }


def state_of(config: dict, step: int, world_size: int, rank: int) -> dict[str, torch.Tensor]:
    """The state the config's job saves at ``step`` (see the module doc)."""
    if config.get("state") == "lora":
        return lora_state(step, world_size, rank)
    return rank_state(step, world_size, rank)


def digests(state: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Each tensor's dtype, shape and sha256 of its bytes."""
    return {
        key: [str(tensor.dtype), str(list(tensor.shape)), hashlib.sha256(tensor.view(torch.uint8).numpy()).hexdigest()]
        for key, tensor in state.items()
    }


def arm_kill(at: str) -> None:
    def die(*_args, **_kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if at == "after-shard":
        write_shards = writer.write_shards
        writer.write_shards = lambda *args, **kwargs: (write_shards(*args, **kwargs), die())[0]
    elif at == "before-commit":
        local._write_manifest = die  # the local tier's commit of the manifest
    else:
        raise ValueError(at)


def wait_until(condition, guard_seconds: float = 120.0) -> None:
    """Wait for ``condition()`` (a guard against a hang, not a timing): raises after ``guard_seconds``."""
    import time

    give_up = time.monotonic() + guard_seconds
    while not condition():
        if time.monotonic() > give_up:
            raise InvalidStateError("a condition the test waits for never came")
        time.sleep(0.02)


def run(config: dict, coordinator: TorchDistributedCoordinator, result: dict) -> None:
    rank, world_size = coordinator.rank, coordinator.world_size
    url = config.get("url_by_rank", {}).get(str(rank), config.get("url"))
    if "config_file" in config:  # as a job configures it: a file, and this process's environment
        local = Path(config["local_root"]) / f"rank-{rank}"
        checkpoints = CheckpointManager.from_config(config["config_file"], local=local, coordinator=coordinator)
    else:
        checkpoints = open_manager(config, rank, url, coordinator)
    try:
        for action in config["actions"]:
            act(action, rank, world_size, checkpoints, coordinator, result, config)
    except CheckpointError as exc:
        result["error"] = [type(exc).__name__, str(exc)]
    try:
        checkpoints.close()
    except CheckpointError as exc:
        result["close_error"] = [type(exc).__name__, str(exc)]


def open_manager(config: dict, rank: int, url: str | None, coordinator: TorchDistributedCoordinator):
    return CheckpointManager(
        LocalOptions(
            Path(config["local_root"]) / ("shared" if config.get("shared_dir") else f"rank-{rank}"),
            keep_last=config.get("keep_last", 3),
            max_awaiting_upload=config.get("max_awaiting_upload", 8),
            **dict(zip(("keep_best", "best_metric", "best_mode"), config.get("keep_best", ()), strict=False)),
        ),
        coordinator=coordinator,
        remote=RemoteOptions(
            url, storage_options=config.get("options") or {}, compression=config.get("compression", "none")
        )
        if url is not None
        else None,
        upload=UploadOptions(**config.get("upload", {"max_tries": 1})),
        runtime=RuntimeOptions(preemption_signals=(signal.SIGUSR1,), stale_saves=config.get("stale_saves", "warn")),
    )


def act(
    action: dict,
    rank: int,
    world_size: int,
    checkpoints: CheckpointManager,
    coordinator: TorchDistributedCoordinator,
    result: dict,
    config: dict,
) -> None:
    if action["do"] == "save":
        step = action.get("step_by_rank", {}).get(str(rank), action["step"])
        state = state_of(config, action.get("state_of", step), world_size, rank)
        if action.get("text_on_rank") == rank:
            state["note"] = np.array(["not a tensor dtype a shard holds"])
        if action.get("float64_on_rank") == rank:
            state["params"] = state["params"].double()  # its slice of the flat vector in another dtype
        if action.get("long_note_on_rank") == rank:
            state["note"] = "é" * 14_500_000  # 7 bytes a character in the header: over the reader's 100 MB
        replicated = rank in action.get("replicated_on_ranks", [])
        checkpoints.save(step, state, metrics=action.get("metrics_by_rank", {}).get(str(rank)), replicated=replicated)
    elif action["do"] == "steps":
        checkpoints.wait()
        result["steps"] = checkpoints.steps()
    elif action["do"] == "wait":
        checkpoints.wait(uploaded=True)
    elif action["do"] == "drain_uploads" and action["rank"] == rank:
        checkpoints._parts.writer.settle()  # the step is queued for upload
        checkpoints._parts.uploader.wait()  # and its upload is over: a failure is recorded, not yet raised
    elif action["do"] == "kill" and action["rank"] == rank:
        arm_kill(action["at"])
    elif action["do"] == "restore_if_any":
        result["restored_if_any"] = checkpoints.restore(missing_ok=True)
    elif action["do"] == "restore":
        read_manifest, reads = RemoteTier.read_manifest, []
        if action.get("count_manifest_reads"):
            RemoteTier.read_manifest = lambda tier, step, **kw: (reads.append(step), read_manifest(tier, step, **kw))[1]
        try:
            restored = checkpoints.restore(reshard=action.get("reshard", False))
        finally:
            RemoteTier.read_manifest = read_manifest
        result["manifest_reads"] = reads
        result["restored"] = {
            "step": restored.step,
            "sources": {str(old): tier for old, tier in restored.sources.items()},
            "digests": digests(restored.torch_state()),
        }
    elif action["do"] == "train":
        for step in range(1, action["steps"] + 1):
            if rank == action["signal_rank"] and step == action["signal_at"]:
                os.kill(os.getpid(), signal.SIGUSR1)
            if checkpoints.reached_preemption(step):
                checkpoints.save(step, rank_state(step, world_size, rank), blocking=True)
                checkpoints.wait(uploaded=True)
                result["preempted_at"] = step
                break
    elif action["do"] == "ask_preemption":
        result["asked"] = checkpoints.reached_preemption(action.get("step_by_rank", {}).get(str(rank), action["step"]))
    elif action["do"] == "count_rounds":  # a blocking save, and the backend collectives it ran here
        before = coordinator.rounds
        checkpoints.save(action["step"], rank_state(action["step"], world_size, rank), blocking=True)
        result.setdefault("rounds", []).append(coordinator.rounds - before)
    elif action["do"] == "long_payloads":  # over the first round's capacity, then within the grown one
        for length in (10_000, 100, 30_000):
            before = coordinator.rounds
            gathered = coordinator.all_gather("x" * (length * (rank + 1)))
            expected = ["x" * (length * (r + 1)) for r in range(world_size)]
            result.setdefault("long", []).append([gathered == expected, coordinator.rounds - before])
    elif action["do"] == "signal":
        Path(f"{action['path']}-{rank}").touch()
    elif action["do"] == "await":
        wait_until(Path(action["path"]).exists)
    elif action["do"] == "saves":
        for step in action["steps"]:
            checkpoints.save(step, rank_state(step, world_size, rank), blocking=True)
    elif action["do"] == "await_queued":  # until the uploader holds at most "at_most" steps
        uploader = checkpoints._parts.uploader
        wait_until(lambda: len(uploader.pending()) <= action["at_most"], action.get("guard_seconds", 120.0))
        result["queued"] = uploader.pending()
    elif action["do"] == "await_retrying":
        wait_until(lambda: checkpoints.lag().retrying_step is not None)
        lag = checkpoints.lag()
        result["retrying"] = [lag.retrying_step, lag.retry_tries]
    elif action["do"] == "collectives":
        result["gathered"] = coordinator.all_gather({"rank": rank})
        result["broadcast"] = coordinator.broadcast(f"from rank {rank}")
        coordinator.barrier()
        try:
            gather(coordinator, "probe", _Rank, lambda: _fail_on_rank(rank, 1))
        except CheckpointError as exc:
            result["agree_error"] = [type(exc).__name__, str(exc)]
            result["agree_error_rank"] = exc.rank
        try:
            leader_decides(coordinator, "verdict", _Rank, lambda: _fail_on_rank(rank, 0))
        except CheckpointError as exc:
            result["decide_error"] = [type(exc).__name__, str(exc)]
        try:  # an exception not of the error tree
            gather(coordinator, "foreign", _Rank, lambda: _fail_on_rank(rank, 1, OSError("disk on fire")))
        except Exception as exc:
            result["foreign_error"] = [type(exc).__name__, str(exc), getattr(exc, "rank", None)]
            result["foreign_error"].append(getattr(exc, "kind", None))
        typed = gather(coordinator, "typed", _Sample, lambda: _sample(rank))
        result["typed_equal"] = typed == [_sample(r) for r in range(coordinator.world_size)]
        result["typed"] = [to_payload(sample) for sample in typed]
        decided = leader_decides(coordinator, "decided", _Sample, lambda: _sample(rank))
        result["decided_equal"] = decided == _sample(0)


@dataclass(frozen=True)
class _Rank:
    rank: int


@dataclass(frozen=True)
class _Sample:
    """A payload of every JSON shape a collective carries: sequences come back as tuples."""

    rank: int
    name: str | None
    pairs: tuple[tuple[str, int], ...]
    flag: bool
    ratio: float


def _sample(rank: int) -> _Sample:
    pairs = tuple((str(i), i) for i in range(rank))
    return _Sample(rank, None if rank % 2 else f"rank {rank}", pairs, rank == 0, rank / 3)


def _fail_on_rank(rank: int, failing: int, error: Exception | None = None) -> _Rank:
    if rank == failing:
        raise error if error is not None else InvalidStateError(f"rank {failing} refuses")
    return _Rank(rank)


def main() -> None:
    serve(run)


def serve(run_job) -> None:
    """Join the job this process's command line names, ``run_job(config, coordinator, result)``
    on its coordinator, and write the result where the config says."""
    config = json.loads(Path(sys.argv[1]).read_text())
    rank = int(sys.argv[2])
    timeout = timedelta(seconds=config.get("timeout_seconds", 60))
    dist.init_process_group(
        "gloo", init_method=f"file://{config['store']}", rank=rank, world_size=config["world_size"], timeout=timeout
    )
    result: dict = {"rank": rank}
    members = config.get("subgroup")
    group = dist.new_group(members) if members else None  # every rank of the job creates it
    try:
        if members is None or rank in members:
            run_job(config, TorchDistributedCoordinator(group, timeout=timeout), result)
    except CheckpointError as exc:
        result["error"] = [type(exc).__name__, str(exc)]
    (Path(config["results"]) / f"rank-{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    # Not destroy_process_group(): after a peer was killed it can wait for that peer.
    os._exit(0)


if __name__ == "__main__":
    main()
