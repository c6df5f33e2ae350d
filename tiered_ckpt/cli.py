"""``tiered-ckpt``: look at, check and move checkpoints from the command line.

Usage (also ``python -m tiered_ckpt``)::

    tiered-ckpt ls [--config FILE] [--json]              every step and its state in each tier
    tiered-ckpt status [--config FILE] [--json]          how far the bucket is behind the local disk
    tiered-ckpt verify [STEP] [--remote] [--config FILE] [--json]   sha256 of every shard in each tier
                                                         (--remote: the bucket, without downloads where it can)
    tiered-ckpt pull [STEP] [--config FILE] [--json]     fill the local tier from the bucket
    tiered-ckpt push [STEP] [--config FILE] [--json]     upload what is not yet in the bucket
    tiered-ckpt prune [--dry-run] [--config FILE] [--json]   apply retention to both tiers
    tiered-ckpt demo [--dir DIR]                         kill -9, a lost disk, a bit-exact resume
    tiered-ckpt bench [ARGS...]                          the benchmark (python -m tiered_ckpt.bench)

The global options (``--config``, ``--local-dir``, ``--remote-url``, ``--json``) go
before or after the command, as in git. Without ``--config`` the ``TIERED_CKPT_*`` environment variables (at least
``TIERED_CKPT_LOCAL_DIR``) describe the tiers; ``--local-dir`` and ``--remote-url``
override both. ``ls``, ``status`` and ``verify`` only read, and work while a job is training;
``pull``, ``push`` and ``prune`` lock the directory as a running manager does. Every
command works on the :class:`~tiered_ckpt.store.TieredStore` the config describes: no
world size, no coordinator.

Exit codes: 0 success; 1 a shard failed verification or an operation failed; 2 bad
usage or an invalid config.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .config import Config, load_config
from .errors import CheckpointError, ConfigError
from .local import LocalTier
from .store import TieredStore
from .uploader import Uploader

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _store(config: Config) -> TieredStore:
    remote = config.remote.open_tier(config.upload) if config.remote is not None else None
    return TieredStore(LocalTier(config.local.dir), remote)


def human_size(size: int) -> str:
    """``size`` bytes in the unit that fits it: 812B, 33.0K, 1.5M, 2.0G."""
    for unit in ("B", "K", "M", "G", "T"):
        if size < 1024 or unit == "T":
            return f"{size}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


def command_ls(config: Config, args: argparse.Namespace) -> tuple[int, Any]:
    rows = []
    now = time.time()
    for status in _store(config).status():
        manifest = status.manifest
        rows.append(
            {
                "step": status.step,
                "local": status.local,
                "remote": status.remote,
                "world_size": manifest.world_size if manifest else None,
                "local_ranks": list(status.held_ranks) if status.held_ranks is not None else None,
                "bytes": manifest.total_bytes if manifest else None,
                "age_seconds": round(now - manifest.wall_clock_seconds, 1) if manifest else None,
            }
        )
    lines = [f"{'STEP':>12}  {'LOCAL':<10} {'REMOTE':<10} {'RANKS':>5} {'SIZE':>10} {'AGE':>10}"]
    for row in rows:
        size = human_size(row["bytes"]) if row["bytes"] is not None else "-"
        age = f"{row['age_seconds'] / 60:.1f}m" if row["age_seconds"] is not None else "-"
        ranks = row["world_size"] or "-"
        if row["local_ranks"] is not None and len(row["local_ranks"]) < row["world_size"]:
            ranks = f"{len(row['local_ranks'])}/{row['world_size']}"  # a node of a multi-process job
        lines.append(f"{row['step']:>12}  {row['local']:<10} {row['remote']:<10} {ranks:>5} {size:>10} {age:>10}")
    return EXIT_OK, (rows, "\n".join(lines))


def command_verify(config: Config, args: argparse.Namespace) -> tuple[int, Any]:
    with tqdm(desc="verify", unit="shard", disable=not sys.stderr.isatty(), leave=False) as bar:
        checks = _store(config).verify(args.step, progress=lambda _check: bar.update(), remote_only=args.remote)
    results = [
        {"step": c.step, "tier": c.tier, "rank": c.rank, "status": c.status, "problem": c.problem} for c in checks
    ]
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


def command_pull(config: Config, args: argparse.Namespace) -> tuple[int, Any]:
    store = _store(config)
    with store.local.lock():
        step, sources = store.pull(args.step)
    fetched = sorted(rank for rank, source in sources.items() if source == "remote")
    return EXIT_OK, (
        {"step": step, "downloaded_ranks": fetched},
        f"step {step}: {len(fetched)} shards downloaded, {len(sources) - len(fetched)} already local",
    )


def command_push(config: Config, args: argparse.Namespace) -> tuple[int, Any]:
    store = _store(config)
    if store.remote is None:
        raise CheckpointError("push needs a remote tier (remote.url)")
    remote_retention = config.remote.retention if config.remote is not None else None
    start = functools.partial(
        Uploader,
        store,
        options=config.upload,
        local_retention=config.local.retention,
        remote_retention=remote_retention,
    )
    with store.local.lock(), closing(start()) as uploader:
        pushed = uploader.push(args.step)
    return EXIT_OK, ({"uploaded_steps": pushed}, f"uploaded steps: {pushed or 'none needed'}")


def command_prune(config: Config, args: argparse.Namespace) -> tuple[int, Any]:
    store = _store(config)
    remote = config.remote.retention if config.remote is not None else None
    deadline = config.upload.deadline_seconds
    with store.local.lock():
        plan = store.prune(config.local.retention, remote, dry_run=args.dry_run, orphans_older_than=deadline or 3600.0)
    verb = "would delete" if args.dry_run else "deleted"
    aborted = f"; aborted unfinished uploads: {plan['aborted']}" if plan["aborted"] else ""
    return EXIT_OK, (
        {"dry_run": args.dry_run, **plan},
        f"{verb}: local {plan['local'] or 'none'}, remote {plan['remote'] or 'none'}{aborted}",
    )


def _global_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """The options every command takes, before or after it (after it, they win)."""
    default = None if top else argparse.SUPPRESS
    parser.add_argument("--config", type=Path, default=default, help="TOML or YAML config (see configs/)")
    parser.add_argument("--local-dir", default=default, help="override local.dir")
    parser.add_argument("--remote-url", default=default, help="override remote.url")
    parser.add_argument("--json", action="store_true", default=False if top else argparse.SUPPRESS, help="print JSON")


def command_status(config: Config, args: argparse.Namespace) -> tuple[int, Any]:
    lag = _store(config).lag()
    waiting = ", ".join(f"{step} ({human_size(size)})" for step, size in lag.waiting) or "none"
    since = f", the oldest for {lag.waiting_seconds / 60:.1f} min" if lag.waiting_seconds is not None else ""
    text = (
        f"newest local step {lag.newest_local}, newest remote step {lag.newest_remote}; "
        f"{lag.steps_behind} steps waiting for upload: {waiting}{since}"
    )
    return EXIT_OK, (lag.to_dict(), text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiered-ckpt", description=__doc__.split("\n\n")[0])
    _global_options(parser, top=True)
    commands = parser.add_subparsers(dest="command", required=True)
    _global_options(commands.add_parser("ls", help="every step and its state in each tier"), top=False)
    _global_options(commands.add_parser("status", help="how far the bucket is behind the local disk"), top=False)
    for name, text in [("verify", "check every shard's sha256"), ("pull", "fill the local tier"), ("push", "upload")]:
        sub = commands.add_parser(name, help=text)
        sub.add_argument("step", type=int, nargs="?", help="one step (default: all, or the newest for pull)")
        if name == "verify":
            sub.add_argument(
                "--remote", action="store_true", help="the bucket only, by the store's own checksums where recorded"
            )
        _global_options(sub, top=False)
    prune = commands.add_parser("prune", help="apply retention to both tiers")
    prune.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
    _global_options(prune, top=False)
    commands.add_parser("demo", help="the demo: a run killed, a disk lost, a bit-exact resume", add_help=False)
    commands.add_parser("bench", help="the benchmark; arguments go to python -m tiered_ckpt.bench", add_help=False)
    return parser


COMMANDS = {
    "ls": command_ls,
    "status": command_status,
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
