"""``tiered-ckpt``: look at, check and move checkpoints from the command line.

Usage (also ``python -m tiered_ckpt``)::

    tiered-ckpt [--config FILE] [--json] ls              every step and its state in each tier
    tiered-ckpt [--config FILE] [--json] verify [STEP]   sha256 of every shard in each tier
    tiered-ckpt [--config FILE] [--json] pull [STEP]     fill the local tier from the bucket
    tiered-ckpt [--config FILE] [--json] push [STEP]     upload what is not yet in the bucket
    tiered-ckpt [--config FILE] [--json] prune [--dry-run]   apply retention to both tiers
    tiered-ckpt demo [--dir DIR]                         kill -9, a lost disk, a bit-exact resume
    tiered-ckpt bench [ARGS...]                          the benchmark (python -m tiered_ckpt.bench)

Without ``--config`` the ``TIERED_CKPT_*`` environment variables (at least
``TIERED_CKPT_LOCAL_DIR``) describe the tiers; ``--local-dir`` and ``--remote-url``
override both. ``ls`` and ``verify`` only read, and work while a job is training;
``pull``, ``push`` and ``prune`` take the directory like a running manager would.

Exit codes: 0 success; 1 a shard failed verification or an operation failed; 2 bad
usage or an invalid config.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .config import Config, load_config
from .errors import CheckpointError, ConfigError
from .layout import parse_step_dir_name, step_dir_name
from .local import check_shard_file, committed_steps, held_ranks, read_manifest
from .manager import CheckpointManager
from .manifest import ShardManifest
from .remote import RemoteTier
from .uploader import read_receipt

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _progress(total: int, description: str) -> tqdm:
    """A progress bar on a terminal, nothing otherwise."""
    return tqdm(total=total, desc=description, unit="shard", disable=not sys.stderr.isatty(), leave=False)


def _local_state(root: Path) -> dict[int, str]:
    states = {}
    if root.is_dir():
        for entry in os.scandir(root):
            step = parse_step_dir_name(entry.name)
            if step is not None and entry.is_dir():
                states[step] = "staged"
    for step in committed_steps(root):
        states[step] = "committed"
    return states


def _remote_tier(config: Config) -> RemoteTier | None:
    return RemoteTier(config.remote.url, config.remote.storage_options) if config.remote else None


def _manifest(
    config: Config, remote: RemoteTier | None, step: int, local: dict[int, str], remote_committed: set[int]
) -> ShardManifest | None:
    """The step's manifest from the local tier, else the remote one; None where neither has it."""
    if local.get(step) == "committed":
        return read_manifest(config.local.dir / step_dir_name(step))
    if remote is not None and step in remote_committed:
        return remote.read_manifest(step).manifest
    return None


def command_ls(config: Config, args: argparse.Namespace) -> tuple[int, Any]:
    local = _local_state(config.local.dir)
    remote = _remote_tier(config)
    remote_committed = set(remote.committed_steps()) if remote else set()
    remote_partial = set(remote.uncommitted_steps()) if remote else set()
    rows = []
    now = time.time()
    for step in sorted(set(local) | remote_committed | remote_partial):
        directory = config.local.dir / step_dir_name(step)
        if step in remote_committed:
            remote_state = "committed"
        elif remote is not None and local.get(step) == "committed" and not read_receipt(directory, remote.url):
            remote_state = "uploading"
        else:
            remote_state = "partial" if step in remote_partial else "-"
        manifest = _manifest(config, remote, step, local, remote_committed)
        held = held_ranks(directory, manifest) if manifest and local.get(step) == "committed" else None
        rows.append(
            {
                "step": step,
                "local": local.get(step, "-"),
                "remote": remote_state,
                "world_size": manifest.world_size if manifest else None,
                "local_ranks": held,
                "bytes": manifest.total_bytes if manifest else None,
                "age_seconds": round(now - manifest.wall_clock_seconds, 1) if manifest else None,
            }
        )
    lines = [f"{'STEP':>12}  {'LOCAL':<10} {'REMOTE':<10} {'RANKS':>5} {'SIZE':>10} {'AGE':>10}"]
    for row in rows:
        size = f"{row['bytes'] / 2**20:.1f}M" if row["bytes"] is not None else "-"
        age = f"{row['age_seconds'] / 60:.1f}m" if row["age_seconds"] is not None else "-"
        ranks = row["world_size"] or "-"
        if row["local_ranks"] is not None and len(row["local_ranks"]) < row["world_size"]:
            ranks = f"{len(row['local_ranks'])}/{row['world_size']}"  # a node of a multi-process job
        lines.append(f"{row['step']:>12}  {row['local']:<10} {row['remote']:<10} {ranks:>5} {size:>10} {age:>10}")
    return EXIT_OK, (rows, "\n".join(lines))


def command_verify(config: Config, args: argparse.Namespace) -> tuple[int, Any]:
    local = _local_state(config.local.dir)
    remote = _remote_tier(config)
    remote_steps = remote.committed_steps() if remote else []
    steps = sorted({s for s, state in local.items() if state == "committed"} | set(remote_steps))
    if args.step is not None:
        if args.step not in steps:
            raise CheckpointError(f"step {args.step} is committed in no tier")
        steps = [args.step]
    results = []
    for step in steps:
        tiers: list[tuple[str, ShardManifest, Any]] = []
        if local.get(step) == "committed":
            directory = config.local.dir / step_dir_name(step)
            tiers.append(("local", read_manifest(directory), lambda r, d=directory: check_shard_file(d, r)))
        if remote is not None and step in remote_steps:
            tiers.append(("remote", remote.read_manifest(step).manifest, lambda r, s=step: remote.check_shard(s, r)))
        for tier, manifest, check in tiers:
            held = held_ranks(config.local.dir / step_dir_name(step), manifest) if tier == "local" else None
            with _progress(manifest.world_size, f"verify step {step} ({tier})") as bar:
                for record in manifest.shards:
                    if held is not None and record.rank not in held:
                        problem, status = None, "elsewhere"  # a node of a multi-process job: not here by design
                    else:
                        problem = check(record)
                        status = "ok" if problem is None else "failed"
                    results.append(
                        {"step": step, "tier": tier, "rank": record.rank, "status": status, "problem": problem}
                    )
                    bar.update()
    failures = [r for r in results if r["status"] == "failed"]
    verified = [r for r in results if r["status"] == "ok"]
    shown = {"ok": "ok", "elsewhere": "held by another node"}
    lines = [
        f"step {r['step']} {r['tier']:<6} rank {r['rank']}: {shown.get(r['status']) or 'FAILED ' + r['problem']}"
        for r in results
    ]
    elsewhere = len(results) - len(failures) - len(verified)
    lines.append(
        f"{len(verified)} shards verified, {len(failures)} failed"
        + (f", {elsewhere} held by other nodes" if elsewhere else "")
    )
    return (EXIT_FAILED if failures else EXIT_OK), (results, "\n".join(lines))


def _manager(config: Config) -> CheckpointManager:
    """A manager for moving whole steps; its world size is that of the newest checkpoint."""
    local = _local_state(config.local.dir)
    remote = _remote_tier(config)
    remote_committed = set(remote.committed_steps()) if remote else set()
    candidates = sorted({s for s, state in local.items() if state == "committed"} | remote_committed)
    manifest = _manifest(config, remote, candidates[-1], local, remote_committed) if candidates else None
    return CheckpointManager.from_config(config, world_size=manifest.world_size if manifest else 1)


def command_pull(config: Config, args: argparse.Namespace) -> tuple[int, Any]:
    with _manager(config) as manager:
        sources = manager.pull(args.step)
        step = args.step if args.step is not None else manager.remote_steps()[-1]
    fetched = sorted(rank for rank, source in sources.items() if source == "remote")
    return EXIT_OK, (
        {"step": step, "downloaded_ranks": fetched},
        f"step {step}: {len(fetched)} shards downloaded, {len(sources) - len(fetched)} already local",
    )


def command_push(config: Config, args: argparse.Namespace) -> tuple[int, Any]:
    with _manager(config) as manager:
        pushed = manager.push(args.step)
    return EXIT_OK, ({"uploaded_steps": pushed}, f"uploaded steps: {pushed or 'none needed'}")


def command_prune(config: Config, args: argparse.Namespace) -> tuple[int, Any]:
    with _manager(config) as manager:
        plan = manager.prune(dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    return EXIT_OK, (
        {"dry_run": args.dry_run, **plan},
        f"{verb}: local {plan['local'] or 'none'}, remote {plan['remote'] or 'none'}",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiered-ckpt", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, help="TOML or YAML config (see configs/)")
    parser.add_argument("--local-dir", help="override local.dir")
    parser.add_argument("--remote-url", help="override remote.url")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("ls", help="every step and its state in each tier")
    for name, text in [("verify", "check every shard's sha256"), ("pull", "fill the local tier"), ("push", "upload")]:
        sub = commands.add_parser(name, help=text)
        sub.add_argument("step", type=int, nargs="?", help="one step (default: all, or the newest for pull)")
    prune = commands.add_parser("prune", help="apply retention to both tiers")
    prune.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
    commands.add_parser("demo", help="the demo: a run killed, a disk lost, a bit-exact resume", add_help=False)
    commands.add_parser("bench", help="the benchmark; arguments go to python -m tiered_ckpt.bench", add_help=False)
    return parser


COMMANDS = {
    "ls": command_ls,
    "verify": command_verify,
    "pull": command_pull,
    "push": command_push,
    "prune": command_prune,
}


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["bench"]:
        from .bench import main as bench_main

        return bench_main(arguments[1:])
    if arguments[:1] == ["demo"]:
        from .demo import main as demo_main

        return demo_main(arguments[1:])
    args = _parser().parse_args(arguments)
    try:
        overrides = {k: v for k, v in (("local_dir", args.local_dir), ("remote_url", args.remote_url)) if v is not None}
        config = load_config(args.config, **overrides)
        code, (data, text) = COMMANDS[args.command](config, args)
    except ConfigError as exc:
        print(f"tiered-ckpt: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CheckpointError as exc:
        print(f"tiered-ckpt: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(json.dumps(data, indent=1) if args.json else text)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
