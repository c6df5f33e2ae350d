"""The ``tiered-ckpt`` command: look at, check and move checkpoints from the command line.

Also ``python -m tiered_ckpt``; ``tiered-ckpt --help`` prints what it does (the commands,
their options and that text are :mod:`tiered_ckpt.cli_parser`'s).
Every command works on the :class:`~tiered_ckpt.tiers.store.TieredStore` the config describes:
no world size, no coordinator.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable, Collection, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tiered_ckpt import maintenance
from tiered_ckpt.build import open_store, replication_policy
from tiered_ckpt.cli_parser import build_parser, run_quietly
from tiered_ckpt.config import Config, load_config
from tiered_ckpt.engine.replication import Replicator
from tiered_ckpt.engine.restore_result import rank_ranges
from tiered_ckpt.errors import CheckpointError, ConfigError, RemoteError, UsageError
from tiered_ckpt.export import export_step
from tiered_ckpt.format.layout import MANIFEST_NAME, parse_step_dir_name
from tiered_ckpt.format.manifest import ShardRecord
from tiered_ckpt.step_diff import StepArrays, diff_steps, step_arrays
from tiered_ckpt.tiers import survey
from tiered_ckpt.tiers.abilities import references_of
from tiered_ckpt.tiers.store import TieredStore

__all__ = ["main", "run"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _store(config: Config) -> TieredStore:
    return open_store(config.local, config.remote, config.upload)


# The option of each load_config override the command line passes (a config's "override 'X'").
_FLAGS = {"local.dir": "--local-dir", "remote.url": "--remote-url", "remote.endpoint_url": "--endpoint-url"}
_OVERRIDE = re.compile(rf"\boverride '({'|'.join(re.escape(key) for key in _FLAGS)})'")


def _as_flags(text: str) -> str:
    """``text`` with each "override 'X'" of :func:`load_config` named as the option the user typed."""
    return _OVERRIDE.sub(lambda match: _FLAGS[match.group(1)], text)


def _origin(config: Config, key: str) -> str:
    """Where a config value came from, as the command line spells it."""
    return _as_flags(config.origins.get(key, config.source))


def _check_local_dir(config: Config, *, may_be_missing: bool) -> None:
    """Refuse a local directory that is a step directory, not a directory, or (unless
    ``may_be_missing``) missing; a read never creates it, and so never reports an empty one
    for a mistyped path."""
    root = config.local.dir
    where = _origin(config, "local.dir")
    if parse_step_dir_name(root.name) is not None or (root / MANIFEST_NAME).is_file():
        raise UsageError(
            f"{root} (local.dir, from {where}): this looks like a step directory; give its parent, {root.parent}"
        )
    if root.exists() and not root.is_dir():
        raise UsageError(f"{root} (local.dir, from {where}) is not a directory")
    if not root.exists() and not may_be_missing:
        raise UsageError(f"{root} (local.dir, from {where}): no such directory")


def human_size(size: int) -> str:
    """``size`` bytes in the unit that fits it: 812B, 33.0K, 1.5M, 2.0G."""
    for unit in ("B", "K", "M", "G", "T"):
        if size < 1024 or unit == "T":
            return f"{size}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


def _progress(description: str, total: int | None = None, unit: str = "it") -> tqdm:
    """A progress bar on stderr, shown only when stderr is a terminal."""
    return tqdm(
        desc=description, total=total, unit=unit, unit_scale=unit == "B", disable=not sys.stderr.isatty(), leave=False
    )


def _absent(state: str) -> str | None:
    return None if state == "-" else state


_UNREACHABLE = "unreachable"  # ls: the remote state of every step while the bucket cannot be reached


def _statuses(config: Config) -> tuple[list[survey.StepStatus], TieredStore, RemoteError | None]:
    """Every step the config's tiers know of, the store listed, and the failure that kept the
    bucket from being listed (None: it was listed). A bucket that cannot be reached now (a
    transient failure, once the retry policy gave up) leaves the local steps to list (a store
    of the local tier alone); one that is missing or refuses access (permanent) fails the command."""
    try:
        store = _store(config)
        return survey.step_statuses(store), store, None
    except RemoteError as exc:
        if not exc.transient or config.remote is None:
            raise
        store = open_store(config.local)
        return survey.step_statuses(store), store, exc


def command_ls(config: Config, args: argparse.Namespace) -> tuple[int, Any]:
    """Every step either tier knows of. A step whose manifest is damaged is listed and marked
    (its problem in ``problem``, and on stderr); the command still exits 0, since the listing
    itself succeeded: ``tiered-ckpt verify`` exits 1 for it. A bucket that cannot be reached
    is said on stderr and in every row's remote state (``unreachable``), the local steps are
    listed, and the command exits 1: the listing is incomplete."""
    rows: list[dict[str, Any]] = []
    now = time.time()
    statuses, store, unreachable = _statuses(config)
    for status in statuses:
        manifest = status.manifest
        rows.append(
            {
                "step": status.step,
                "local": _absent(status.local),
                "remote": _UNREACHABLE if unreachable is not None else _absent(status.remote),
                "world_size": manifest.world_size if manifest else None,
                "local_ranks": list(status.held_ranks) if status.held_ranks is not None else None,
                "bytes": manifest.total_bytes if manifest else None,
                "referenced_bytes": manifest.referenced_bytes if manifest else None,
                "age_seconds": round(now - manifest.wall_clock_seconds, 1) if manifest else None,
                "metrics": dict(manifest.metrics) if manifest else None,
                "problem": status.problem,
            }
        )
    rows = _with_kept(store, rows)
    lines = [f"{'STEP':>12}  {'LOCAL':<10} {'REMOTE':<10} {'RANKS':>5} {'SIZE':>10} {'AGE':>10} {'REFERENCED':>11}"]
    for row in rows:
        size = human_size(row["bytes"]) if row["bytes"] is not None else "-"
        referenced = human_size(row["referenced_bytes"]) if row["referenced_bytes"] else "-"
        age = f"{row['age_seconds'] / 60:.1f}m" if row["age_seconds"] is not None else "-"
        ranks = row["world_size"] or "-"
        if row["local_ranks"] is not None and len(row["local_ranks"]) < row["world_size"]:
            ranks = f"{len(row['local_ranks'])}/{row['world_size']}"  # a node of a multi-process job
        local, remote = row["local"] or "-", row["remote"] or "-"
        damaged = "  DAMAGED" if row["problem"] else ""
        metrics = "".join(f"  {name}={_metric(value)}" for name, value in (row.get("metrics") or {}).items())
        line = f"{row['step']:>12}  {local:<10} {remote:<10} {ranks:>5} {size:>10} {age:>10} {referenced:>11}"
        lines.append(line + damaged + metrics)
    for row in rows:
        if row["problem"]:
            print(
                f"tiered-ckpt: step {row['step']} is damaged: {row['problem']} (see tiered-ckpt verify {row['step']})",
                file=sys.stderr,
            )
    if unreachable is not None:
        print(
            f"tiered-ckpt: the bucket could not be reached; only the local steps are listed, each remote state "
            f"shown as {_UNREACHABLE}: {unreachable}",
            file=sys.stderr,
        )
        return EXIT_FAILED, (rows, "\n".join(lines))
    return EXIT_OK, (rows, "\n".join(lines))


def _metric(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def _with_kept(store: TieredStore, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with each tier's kept steps (files of a deleted step that retained steps reference)
    in its state column as ``kept``: a step no tier holds otherwise gets a row of its own, its
    ``bytes`` the local kept files' (None where only the bucket keeps it)."""
    by_step = {row["step"]: row for row in rows}
    for tier in store.tiers:
        referencing = references_of(tier)
        column = "local" if tier is store.local else "remote"
        if referencing is None or (column == "remote" and tier is not store.remote):
            continue
        for step in referencing.kept_steps():
            row = by_step.setdefault(step, {"step": step, "local": None, "remote": None, "world_size": None})
            if row.get(column) is None:
                row[column] = "kept"
            if "bytes" not in row:
                row.update(
                    bytes=None, local_ranks=None, referenced_bytes=None, age_seconds=None, metrics=None, problem=None
                )
            if column == "local" and row["world_size"] is None:
                row["bytes"] = store.local.kept_bytes(step)
    return [by_step[step] for step in sorted(by_step)]


def command_verify(config: Config, args: argparse.Namespace) -> tuple[int, Any]:
    store = _store(config)
    if args.remote and store.remote is None:
        raise UsageError("verify --remote needs a remote tier (remote.url, --remote-url or TIERED_CKPT_REMOTE_URL)")
    with _progress("verify", unit="shard") as bar:

        def checked(_check: survey.ShardCheck) -> None:
            bar.update()

        checks = survey.verify(store, args.step, progress=checked, later_only=args.remote).checks
    results: list[dict[str, Any]] = [
        {"step": c.step, "tier": c.tier, "rank": c.rank, "status": c.status, "problem": c.problem} for c in checks
    ]
    failures = [r for r in results if r["status"] == "failed"]
    verified = [r for r in results if r["status"] == "ok"]
    shown = {"ok": "ok", "elsewhere": "held by another node"}
    lines = [
        f"step {r['step']} {r['tier']:<6} {'manifest' if r['rank'] is None else 'rank ' + str(r['rank'])}: "
        f"{shown.get(r['status']) or 'FAILED ' + r['problem']}"
        for r in results
    ]
    on_other_nodes = len(results) - len(failures) - len(verified)
    lines.append(
        f"{len(verified)} shards verified, {len(failures)} failed"
        + (f", {on_other_nodes} held by other nodes" if on_other_nodes else "")
        + ("" if results else f" (no committed step in {store.where()})")
    )
    return (EXIT_FAILED if failures else EXIT_OK), (results, "\n".join(lines))


def command_pull(config: Config, args: argparse.Namespace) -> tuple[int, Any]:
    store = _store(config)
    with store.local.lock(), _progress("pull", unit="B") as bar:

        def landed(record: ShardRecord, _source: str) -> None:
            bar.update(record.size_bytes)

        pulled = maintenance.pull(store, args.step, progress=landed)
    step, sources = pulled.step, pulled.sources
    fetched = sorted(rank for rank, source in sources.items() if source != store.local.name)
    return EXIT_OK, (
        {"step": step, "downloaded_ranks": fetched},
        f"step {step}: {len(fetched)} shards downloaded, {len(sources) - len(fetched)} already local",
    )


def command_push(config: Config, args: argparse.Namespace) -> tuple[int, Any]:
    """Queue every step the bucket lacks at once (the uploader goes through them as it does
    after an outage), then wait. A step that fails does not stop the others; the steps
    uploaded are reported either way, each failure on stderr, and the command exits 1."""
    store = _store(config)
    if store.remote is None:
        raise UsageError("push needs a remote tier (remote.url, --remote-url or TIERED_CKPT_REMOTE_URL)")
    ownership = config.remote.ownership if config.remote is not None else None
    failures: list[CheckpointError] = []
    with (
        store.local.lock(),
        closing(
            Replicator(store, store.remote, policy=replication_policy(config.upload), ownership=ownership)
        ) as uploader,
        _progress("push", unit="step") as bar,
    ):

        def done(uploaded: int, queued: int) -> None:
            if bar.total != queued:
                bar.total = queued
                bar.refresh()  # the bar with its total, before any step is up
            bar.update(uploaded - bar.n)

        pushed = list(maintenance.push(store, uploader, args.step, progress=done).steps)
        while True:
            try:
                uploader.errors.raise_first()
            except CheckpointError as exc:
                failures.append(exc)
            else:
                break
    failed = {getattr(error, "step", None) for error in failures}
    for error in failures:
        print(f"tiered-ckpt: {type(error).__name__}: {error}", file=sys.stderr)
    data: dict[str, Any] = {"uploaded_steps": pushed}
    text = f"uploaded steps: {pushed or 'none needed'}"
    if failures:
        data["failed_steps"] = sorted(step for step in failed if step is not None)
        text = f"uploaded steps: {pushed or 'none'}; failed: {data['failed_steps']}"
    return (EXIT_FAILED if failures else EXIT_OK), (data, text)


def command_prune(config: Config, args: argparse.Namespace) -> tuple[int, Any]:
    store = _store(config)
    with store.local.lock():
        pruned = maintenance.prune(store, config.remote, dry_run=args.dry_run)
    plan = {
        "local": list(pruned.deleted[store.local.name]),
        "remote": list(pruned.deleted[store.remote.name]) if store.remote is not None else [],
        "aborted": list(pruned.aborted),
        "local_kept_unproven": list(pruned.kept_unproven),
    }
    verb = "would delete" if args.dry_run else "deleted"
    aborted = f"; aborted unfinished uploads: {plan['aborted']}" if plan["aborted"] else ""
    kept = ""
    if plan["local_kept_unproven"]:
        kept = (
            f"\nkept local steps {plan['local_kept_unproven']}: no newer step is known to be complete on every rank "
            f"(in {store.local.root}, the directory of one rank of a multi-process job, one rank's commit proves "
            "nothing of the others); the job's own retention deletes them once its ranks agree on a newer step, "
            "or give the bucket holding a newer step (--remote-url)"
        )
    return EXIT_OK, (
        {"dry_run": args.dry_run, **plan},
        f"{verb}: local {plan['local'] or 'none'}, remote {plan['remote'] or 'none'}{aborted}{kept}",
    )


def command_show(config: Config, args: argparse.Namespace) -> tuple[int, Any]:
    """The arrays of one step, rank by rank: tensor name (what ``restore(paths=...)`` takes),
    dtype, shape and bytes, from each shard's header, verified, read from the nearest tier
    (a few KB per shard: no shard is read whole, nothing is written).

    On one rank's directory of a multi-process job (no bucket holding the step), the ranks
    whose shards are on other nodes' disks are named on stderr and left out."""
    found = step_arrays(_store(config), args.step)
    manifest = found.manifest
    rows: list[dict[str, Any]] = [
        {
            "rank": a.rank,
            "name": a.name,
            "dtype": a.dtype,
            "shape": list(a.shape),
            "bytes": a.bytes,
            "tier": a.tier,
            "stored_in": a.stored_in,
        }
        for a in found.arrays.values()
    ]
    lines = [f"{'RANK':>5}  {'DTYPE':<5} {'SHAPE':<20} {'SIZE':>9}  NAME"]
    for row in rows:
        shape = "x".join(map(str, row["shape"])) or "scalar"
        where = f"  (in step {row['stored_in']})" if row["stored_in"] is not None else ""
        size = human_size(row["bytes"])
        lines.append(f"{row['rank']:>5}  {row['dtype']:<5} {shape:<20} {size:>9}  {row['name']}{where}")
    missing = found.missing_ranks
    shards = f"{manifest.world_size - len(missing)} of {manifest.world_size}" if missing else manifest.world_size
    metrics = ", ".join(f"{name}={_metric(value)}" for name, value in manifest.metrics)
    summary = f"step {args.step}: {len(rows)} arrays in {shards} shards, {_owned(found)}"
    lines.append(summary + (f"; metrics {metrics}" if metrics else ""))
    _say_missing(config, args.step, found)
    return EXIT_OK, (rows, "\n".join(lines))


def _owned(found: StepArrays) -> str:
    """``1.2 GiB``, or ``16.0 MiB own, 2.0 GiB referenced in earlier steps``."""
    if not found.referenced_bytes:
        return human_size(found.own_bytes)
    return f"{human_size(found.own_bytes)} own, {human_size(found.referenced_bytes)} referenced in earlier steps"


def _say_missing(config: Config, step: int, found: StepArrays) -> None:
    """On stderr: the ranks of ``step`` whose shards are on other nodes' disks, if any."""
    if not found.missing_ranks:
        return
    held = [record.rank for record in found.manifest.shards if record.rank not in found.missing_ranks]
    print(
        f"tiered-ckpt: step {step}: {config.local.dir} holds the shards of {_ranks(held)} of "
        f"{found.manifest.world_size} (one node's part of a multi-process job); those of "
        f"{_ranks(found.missing_ranks)} are on other nodes' disks: give the bucket holding the step "
        "(--remote-url) to list them too",
        file=sys.stderr,
    )


def command_diff(config: Config, args: argparse.Namespace) -> tuple[int, Any]:
    """How step ``second`` differs from step ``first``, array by array, from manifests and
    headers only (:func:`~tiered_ckpt.step_diff.diff_steps`)."""
    diff = diff_steps(_store(config), args.first, args.second)
    lines = [f"{'RANK':>5}  {'CHANGE':<8} {'BEFORE':<26} {'AFTER':<26} NAME"]
    for change in diff.changes:
        before = f"{change.before.describe()} ({human_size(change.before.bytes)})" if change.before else "-"
        after = f"{change.after.describe()} ({human_size(change.after.bytes)})" if change.after else "-"
        lines.append(f"{change.rank:>5}  {change.change:<8} {before:<26} {after:<26} {change.name}")
    counts = {kind: sum(1 for c in diff.changes if c.change == kind) for kind in ("added", "removed")}
    changed = len(diff.changes) - counts["added"] - counts["removed"]
    unknown = sum(1 for c in diff.changes if c.change == "unknown")
    lines.append(
        f"step {args.first} -> step {args.second}: {_count(changed, 'array')} changed"
        + (f" ({unknown} of them unknown: no digest recorded)" if unknown else "")
        + f", {counts['added']} added, {counts['removed']} removed, {diff.same} the same"
    )
    for side in (diff.first, diff.second):
        found = side.manifest
        lines.append(f"step {found.step}: {_count(found.world_size, 'rank')}, {_owned(side)}")
    _say_missing(config, args.first, diff.first)
    _say_missing(config, args.second, diff.second)
    return EXIT_OK, (diff.to_dict(), "\n".join(lines))


def _count(count: int, thing: str) -> str:
    """``1 array``, ``3 arrays``."""
    return f"{count} {thing}{'' if count == 1 else 's'}"


def _ranks(ranks: Collection[int]) -> str:
    """``rank 2`` or ``ranks 0-1,3``."""
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {rank_ranges(ranks)}"


def command_export(config: Config, args: argparse.Namespace) -> tuple[int, Any]:
    """Write a step as a Hugging Face style safetensors checkpoint (see :mod:`tiered_ckpt.export`),
    or with ``--format lightning`` as a Lightning ``.ckpt`` (:mod:`tiered_ckpt.lightning_export`)."""
    if args.format == "lightning":
        return _export_lightning(config, args)
    if args.full:
        raise UsageError("--full applies to --format lightning only (safetensors holds the tensors of the step)")
    only = args.only  # a top-level key, a tensor name as show lists it, or the start of some
    most = 5 * 10**9 if args.max_shard_size is None else args.max_shard_size
    with _progress("export", unit="file"):
        result = export_step(_store(config), args.step, args.directory, only=only, max_shard_bytes=most)
    files = [{"name": f.name, "bytes": f.size_bytes, "sha256": f.sha256} for f in result.files]
    data = {
        "step": result.step,
        "directory": str(result.directory),
        "files": files,
        "tensors": len(result.tensors),
        "skipped": list(result.skipped),
        "largest_tensor_bytes": result.largest_tensor_bytes,
    }
    lines = [f"{f['sha256']}  {f['name']}" for f in files]
    lines.append(
        f"step {result.step}: {len(result.tensors)} tensors in {len(files)} files under {result.directory}"
        + (f"; not tensors, left out: {', '.join(result.skipped)[:300]}" if result.skipped else "")
    )
    return EXIT_OK, (data, "\n".join(lines))


def _export_lightning(config: Config, args: argparse.Namespace) -> tuple[int, Any]:
    """The step as one Lightning ``.ckpt`` file (needs torch and lightning, imported here only)."""
    if args.only is not None or args.max_shard_size is not None:
        raise UsageError("--only and --max-shard-size apply to --format safetensors; a .ckpt is one file")
    from tiered_ckpt.lightning_export import write_lightning_file
    from tiered_ckpt.lightning_load import read_step

    written = write_lightning_file(read_step(_store(config), args.step), args.directory, full=args.full)
    path = Path(args.directory).absolute()
    data = {"step": args.step, "file": str(path), "bytes": written.size_bytes, "sha256": written.sha256}
    text = f"{written.sha256}  {path}\nstep {args.step}: {human_size(written.size_bytes)} in {path}"
    return EXIT_OK, (data, text + ("" if args.full else " (weights and hyper-parameters)"))


def command_status(config: Config, args: argparse.Namespace) -> tuple[int, Any]:
    lag = maintenance.lag(_store(config))
    waiting = ", ".join(f"{step} ({human_size(size)})" for step, size in lag.waiting) or "none"
    since = f", the oldest for {lag.waiting_seconds / 60:.1f} min" if lag.waiting_seconds is not None else ""
    text = (
        f"newest local step {lag.newest_local}, newest remote step {lag.newest_remote}; "
        f"{lag.steps_behind} steps waiting for upload: {waiting}{since}"
    )
    return EXIT_OK, (lag.to_dict(), text)


COMMANDS: dict[str, Callable[[Config, argparse.Namespace], tuple[int, Any]]] = {
    "ls": command_ls,
    "status": command_status,
    "verify": command_verify,
    "pull": command_pull,
    "push": command_push,
    "prune": command_prune,
    "show": command_show,
    "diff": command_diff,
    "export": command_export,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return its exit code (see :func:`~tiered_ckpt.cli_parser.run_quietly`
    for a reader that closes the output early)."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    return run_quietly(lambda: run(arguments))


def run(arguments: list[str]) -> int:
    """Run the command ``arguments`` name; its exit code."""
    if arguments[:1] == ["demo"]:
        from tiered_ckpt.demo import main as demo_main

        return demo_main(arguments[1:])
    args = build_parser().parse_args(arguments)
    given = {name: getattr(args, flag.removeprefix("--").replace("-", "_")) for name, flag in _FLAGS.items()}
    try:
        config = load_config(args.config, overrides={key: value for key, value in given.items() if value is not None})
        # pull creates the directory it fills; verify --remote, and the commands that only read,
        # read the bucket alone if need be
        reads_only = args.command in ("ls", "status", "show", "diff", "export")
        bucket_only = (getattr(args, "remote", False) or reads_only) and config.remote is not None
        _check_local_dir(config, may_be_missing=args.command == "pull" or bucket_only)
        if bucket_only and not config.local.dir.exists():  # said, so that a mistyped directory is noticed
            where = _origin(config, "local.dir")
            said = f"{config.local.dir} (local.dir, from {where}) does not exist; reading the bucket alone"
            print(f"tiered-ckpt: {said}", file=sys.stderr)
        code, (data, text) = COMMANDS[args.command](config, args)
    except (ConfigError, UsageError) as exc:
        print(f"tiered-ckpt: {_as_flags(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except CheckpointError as exc:
        print(f"tiered-ckpt: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:  # the file system refused what a command writes (export's directory)
        print(f"tiered-ckpt: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(json.dumps(data, indent=1) if args.json else text)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
