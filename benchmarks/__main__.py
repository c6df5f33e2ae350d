"""Benchmark: save and load+verify speed next to this machine's limits, measured in the same run.

Usage, from the repository root: ``python -m benchmarks [--size-gib 2] [--ranks 4] [--repeat 5]
[--dir DIR] [--only SECTION ...] [--peers] [--plot FILE.png]``

Prints the median GB/s of each measurement over ``--repeat`` rounds and the ratios the
project targets, each the median of the rounds' own ratios (the disk's speed swings
within a minute, so a figure is only compared with the limit measured in the same
round). One module per section, each saying what it measures: ``sync`` (save and loads
next to the disk's and sha256's limits), ``async`` (in ``async_save.py``), ``retention``,
``dist`` (rank processes), ``train``, ``remote`` (moto's S3 server next to boto3, as it
answers and through a model of S3's limits: ``bucket_model.py``),
``compression`` (zstd-compressed bucket objects next to plain ones), ``structure``,
``fsdp`` (next to DCP), ``small-arrays`` (40,000 small arrays next to the same bytes in
four), ``peer`` (a lost node restored from its partners' memory, and a
partner copy's cost), ``parts`` (a partial restore and an export), ``scale`` (per-save
overhead at many rank processes next to ``dcp.save``, and a leader's work at thousands of
simulated ranks), ``requests`` (the bucket requests of a save and a restore at 1,024 and 4,096
simulated ranks, by kind), ``memory`` (a save's and a restore's peak resident memory against the
host memory budget, in fresh processes), ``incremental`` (what an incremental save writes
and costs, LoRA and pretraining shapes, next to full saves), ``fresh`` (each method and each limit in a fresh
process, next to issue 45's targets; not run by default) and, with
``--peers``, ``peers`` (safetensors, ``torch.save``, DCP on the same state); ``--plot
FILE.png`` draws the peers table (needs matplotlib: ``pip install -e '.[bench]'``). What
they share is in :mod:`benchmarks.harness`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks import (
    async_save,
    bucket_model,
    compression,
    dist,
    fresh,
    fresh_worker,
    fsdp,
    incremental,
    memory,
    parts,
    peer,
    peers,
    remote,
    requests,
    retention,
    scale,
    small_arrays,
    structure,
    sync,
    train,
)
from benchmarks.harness import Target, check_plotting, make_states, parser, positive, print_targets

__all__ = ["main"]

SECTIONS = (
    *("sync", "async", "retention", "dist", "train", "remote", "compression"),
    *("structure", "small-arrays", "fsdp", "peer", "parts", "scale", "requests", "memory", "incremental"),
    *("fresh", "peers"),
)
DEFAULT = tuple(section for section in SECTIONS if section not in ("fresh", "peers"))
# Issue 45's items with a ratio and the sections that measure each: a section returns its Target
# rows and the summary at the end prints them all, and names the items no section of the run measured.
ISSUE_45 = {
    2: "sections remote, peer",
    3: "section requests",
    4: "section small-arrays",
    5: "section fresh",
    7: "sections fresh, scale",
}
IN_MEMORY = {"sync", "async", "retention", "peers"}  # the sections measuring one state made here


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen sections in a scratch directory, removed afterwards; 0 when all ran."""
    command = parser(SECTIONS, __doc__.split("\n\n")[0])
    for section, counts in (
        ("dist", dist.RANK_PROCESSES),
        ("fsdp", fsdp.RANK_PROCESSES),
        ("scale", scale.RANK_PROCESSES),
    ):
        command.add_argument(
            f"--{section}-processes",
            type=positive,
            nargs="+",
            default=list(counts),
            metavar="N",
            help=f"rank process counts for '{section}' (default {' '.join(map(str, counts))})",
        )
    command.add_argument(
        "--requests-ranks",
        type=positive,
        nargs="+",
        default=list(requests.RANKS),
        metavar="N",
        help=f"simulated rank counts for 'requests' (default {' '.join(map(str, requests.RANKS))})",
    )
    command.add_argument(
        "--buckets",
        nargs="+",
        choices=remote.BUCKETS,
        default=list(remote.BUCKETS),
        help="the buckets of 'remote' and 'peer': moto as it answers, and through the bucket model (default both)",
    )
    args = command.parse_args(argv)
    sections = args.only or list(DEFAULT)
    if args.peers or args.plot:
        sections = [*sections, "peers"]
    if args.plot is not None:
        check_plotting(args.plot)

    states = make_states(int(args.size_gib * 2**30), args.ranks) if IN_MEMORY & set(sections) else []
    total = int(args.size_gib * 2**30)
    print(
        f"state: {total / 2**30:.2f} GiB over {args.ranks} ranks, medians of {args.repeat} runs, cpus={os.cpu_count()}"
    )
    # Sections that write many gigabytes remove each round's files after it (see harness.clear()).
    root = Path(tempfile.mkdtemp(prefix="tiered-ckpt-bench-", dir=args.dir))
    targets: list[Target] = []
    try:
        if "sync" in sections:
            print("save_sharded / load_sharded:")
            sync.bench_sync(states, root, args.repeat)
        if "async" in sections:
            print("CheckpointManager async save:")
            async_save.bench_async(states, root, args.repeat)
        if "retention" in sections:
            print("CheckpointManager blocking save, with and without local retention (interleaved):")
            retention.bench_retention(states, root, args.repeat)
        if "dist" in sections:
            print("rank processes under torch.distributed (gloo), each saving its part to the same disk:")
            dist.bench_dist(total, root, args.repeat, args.dist_processes)
        if "remote" in sections:
            print("remote tier (upload and download, against boto3 on the same server):")
            model = bucket_model.__name__
            targets += remote.bench_remote(args.remote_size_gib, args.ranks, root, args.repeat, model, args.buckets)
        if "compression" in sections:
            print("compression of bucket objects (zstd next to none, on the same server):")
            compression.bench_compression(args.remote_size_gib, args.ranks, root, args.repeat)
        if "structure" in sections:
            print("the structure document of a nested optimizer state (save_sharded / load_sharded, warm):")
            structure.bench_structure(args.params, total, root, args.repeat)
        if "small-arrays" in sections:
            print("one shard of many small arrays next to the same bytes in a few large ones (save_sharded):")
            targets += small_arrays.bench_small_arrays(
                args.small_arrays_mib << 20, args.small_arrays, root, args.repeat
            )
        if "fsdp" in sections:
            print("FSDP2 state from rank processes (gloo), next to torch.distributed.checkpoint on the same disk:")
            fsdp.bench_fsdp(total, root, args.repeat, args.fsdp_processes)
        if "peer" in sections:
            print("peer tier: 4 ranks as 2 nodes (gloo), a lost node's restore and what a partner copy costs:")
            targets += peer.bench_peer(total, root, args.repeat, args.train_steps, bucket_model.__name__, args.buckets)
        if "parts" in sections:
            print("restoring a part (paths=) and exporting one safetensors checkpoint, warm:")
            parts.bench_parts(total, args.ranks, root, args.repeat)
        if "scale" in sections:
            print("per-save overhead as the ranks grow: rank processes next to dcp.save, and a leader of N ranks:")
            targets += scale.bench_scale(root, args.repeat, args.scale_processes)
        if "requests" in sections:
            print("bucket requests of one save and one restore by the leader of N simulated ranks (moto, counted):")
            targets += requests.bench_requests(root, args.requests_ranks)
        if "memory" in sections:
            print("host memory: a save's and a restore's peak growth against runtime.host_memory_bytes:")
            memory.bench_memory(root, args.repeat, budget=max(16 << 20, total // 32))
        if "incremental" in sections:
            print("incremental saves (runtime.incremental) next to full ones, interleaved rounds:")
            incremental.bench_incremental(total, root, args.repeat)
        if "peers" in sections:
            print("peers: the same state saved and loaded by each (interleaved rounds):")
            table = peers.bench_peers(states, root, args.repeat)
            if args.plot is not None:
                peers.plot(table, args.plot)
                print(f"  plot written to {args.plot}")
        if "fresh" in sections:
            print("fresh processes: each method and each limit in a process of its own (rotated rounds):")
            targets += fresh.bench_fresh(total, args.ranks, root, args.repeat, worker=fresh_worker.__name__)
        if "train" in sections:
            del states
            print("training loop (numpy matmuls, checkpoint every 20 steps):")
            train.bench_train(root, args.ranks, args.train_steps, args.repeat)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if targets:
        print("issue 45, every target measured in this run (met / not met):")
        print_targets(targets, ISSUE_45)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
