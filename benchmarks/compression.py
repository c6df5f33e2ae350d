"""The ``compression`` section of the benchmark: zstd-compressed bucket objects next to plain ones.

Three states of ``--remote-size-gib`` each, over ``ranks`` shards, go up to moto's S3 server
(its own process, on loopback) through the remote tier with ``compression="none"`` and
``"zstd"``, interleaved, each round into fresh buckets, and come back verified:

- a bf16 model with its fp32 master copy and AdamW moments (mixed-precision training);
- an fp32 model with its AdamW moments;
- fp32 arrays of random bits (incompressible: what compression costs when it gains nothing;
  random *uniform* values would not do, their exponents take few values and compress).

The model states look trained (layers of different scales, small-magnitude weights, moments
several orders of magnitude apart): random uniform bytes compress not at all and are not
what models look like. Printed: the bytes the bucket holds, upload and download+verify time
(zstd over none, each the median of the rounds' own ratios) and the CPU seconds one
thread spends compressing a GiB of shard (median over shards and rounds). moto's upload
speed (tens of MB/s) is far below a real store's: the times say what compression saves on
a slow link, the CPU figure what it costs on any. Run through ``python -m benchmarks``
(``--only compression``; needs moto and boto3: the bench extra).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from benchmarks.harness import clear, moto_server, show_ratio, timed
from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.io.parallel import run_parallel
from tiered_ckpt.oneshot import save_sharded

__all__ = ["bench_compression"]

_LAYERS = 24


def _layered(rng: np.random.Generator, numel: int, scales: tuple[float, float]) -> np.ndarray:
    """``numel`` normal fp32 values in layers, each of a scale drawn log-uniformly from ``scales``."""
    out = np.empty(numel, np.float32)
    for chunk in np.array_split(np.arange(numel), _LAYERS):
        scale = 10 ** rng.uniform(np.log10(scales[0]), np.log10(scales[1]))
        out[chunk] = rng.standard_normal(len(chunk), dtype=np.float32) * scale
    return out


def _adamw(rng: np.random.Generator, numel: int) -> dict[str, np.ndarray]:
    """AdamW moments: the first of gradients' scale (1e-5..1e-3), the second their squares (positive)."""
    grads = _layered(rng, numel, (1e-5, 1e-3))
    return {"exp_avg": grads * 0.1, "exp_avg_sq": grads * grads * 0.01 + np.float32(1e-12)}


def _state(kind: str, total_bytes: int, ranks: int, rank: int) -> dict[str, Any]:
    rng = np.random.default_rng(rank)
    if kind == "bf16 model + fp32 AdamW":  # 2 + 4 + 4 + 4 bytes per parameter
        numel = total_bytes // ranks // 14
        weights = _layered(rng, numel, (0.005, 0.05))
        return {"model": weights.astype(ml_dtypes.bfloat16), "master": weights, **_adamw(rng, numel)}
    if kind == "fp32 model + AdamW":  # 4 + 4 + 4 bytes per parameter
        numel = total_bytes // ranks // 12
        return {"model": _layered(rng, numel, (0.005, 0.05)), **_adamw(rng, numel)}
    return {"noise": rng.integers(0, 2**32, total_bytes // ranks // 4, dtype=np.uint32).view(np.float32)}


MODES = ("none", "zstd")
KINDS = {  # each state, and the target of its bucket bytes, zstd / none
    "bf16 model + fp32 AdamW": "<= 0.90",
    "fp32 model + AdamW": "<= 0.95",
    "random fp32 bits": "<= 1.001",
}


def _codec_cpu(directory: Path, manifest: ShardManifest) -> list[tuple[float, float]]:
    """Per shard, the CPU seconds per GiB (of shard) one thread takes to make its compressed copy
    (read, check, compress, hash, write) and to decompress that copy again (read, decompress)."""
    from tiered_ckpt.io.zstd_frames import FramesReader
    from tiered_ckpt.tiers.remote.compression import compressed_copy

    costs = []
    for record in manifest.shards:
        path, gib = directory / record.path, record.size_bytes / 2**30
        start = time.thread_time()
        with compressed_copy(path, record, str(path)) as (copy, stored):
            compressing = time.thread_time() - start
            start = time.thread_time()
            with open(copy, "rb") as source:
                reader = FramesReader(source, stored.index(record.size_bytes), str(copy))
                while reader.read(8 << 20):
                    pass
            costs.append((compressing / gib, (time.thread_time() - start) / gib))
    return costs


def _round(
    bucket: str, client: Any, options: dict[str, Any], source: Path, manifest: ShardManifest, mode: str, target: Path
) -> dict[str, float]:
    """One upload and one verified download of the step with ``compression=mode``, into a fresh bucket."""
    from tiered_ckpt.engine.replication import Replicator
    from tiered_ckpt.tiers.local import LocalTier
    from tiered_ckpt.tiers.remote.tier import RemoteTier
    from tiered_ckpt.tiers.store import TieredStore

    client.create_bucket(Bucket=bucket)
    tier = RemoteTier(f"s3://{bucket}/run", options, compression=mode)
    store = TieredStore([LocalTier(source), tier])
    with store.local.lock(), contextlib.closing(Replicator(store)) as uploader:
        cpu = time.process_time()
        upload = timed(lambda: _push(store, uploader, manifest.step))
        cpu = time.process_time() - cpu
    stored = tier.read_manifest(manifest.step).compression
    held = sum(stored[r.path].size_bytes if r.path in stored else r.size_bytes for r in manifest.shards)
    reader = TieredStore([LocalTier(target), RemoteTier(f"s3://{bucket}/run", options)])  # goes by the manifest
    with reader.local.lock():
        reader.local.new_step_dir(manifest.step)
        download = functools.partial(reader.download_shard, manifest.step)
        seconds = timed(lambda: run_parallel(download, manifest.shards, None))
    clear(target)
    return {"upload": upload, "upload cpu": cpu, "download": seconds, "bytes": held}


def _paired(rounds: list[dict[str, dict[str, float]]], name: str) -> float:
    """The median over rounds of each round's zstd figure over its none figure."""
    return statistics.median(each["zstd"][name] / each["none"][name] for each in rounds)


@dataclass
class _Measured:
    """One state's rounds (by mode: upload and download seconds, uploading CPU, bucket bytes)
    and its codec's CPU seconds per GiB (compress, decompress: one pair per shard and round)."""

    kind: str
    gib: float
    rounds: list[dict[str, dict[str, float]]] = field(default_factory=list)
    cpu: list[tuple[float, float]] = field(default_factory=list)

    def rate(self, mode: str, name: str) -> float:
        return self.gib * 2**30 / statistics.median(each[mode][name] for each in self.rounds) / 1e6

    def codec(self, which: int) -> float:
        return statistics.median(each[which] for each in self.cpu)

    def describe(self, ranks: int) -> str:
        cpu = {mode: statistics.median(each[mode]["upload cpu"] for each in self.rounds) / self.gib for mode in MODES}
        saved = (1 - _paired(self.rounds, "bytes")) * 2**30 / 1e6  # MB saved per GiB of shard
        pays = f"on links below {saved / self.codec(0):.0f} MB/s per compressing core" if saved > 1 else "never"
        return (
            f"  {self.kind}: {self.gib:.2f} GiB in {ranks} shards; upload none {self.rate('none', 'upload'):.0f}, "
            f"zstd {self.rate('zstd', 'upload'):.0f} MB/s; download+verify none {self.rate('none', 'download'):.0f}, "
            f"zstd {self.rate('zstd', 'download'):.0f} MB/s (of shard bytes); uploading process CPU none "
            f"{cpu['none']:.2f}, zstd {cpu['zstd']:.2f} s/GiB; compressing pays for its time {pays}"
        )

    def print_ratios(self, target: str) -> None:
        show_ratio(f"{self.kind}: bucket bytes, zstd / none", _paired(self.rounds, "bytes"), target)
        show_ratio(f"{self.kind}: upload time, zstd / none", _paired(self.rounds, "upload"), "< 1.0 on a slow link")
        show_ratio(
            f"{self.kind}: download+verify, zstd / none", _paired(self.rounds, "download"), "< 1.0 on a slow link"
        )
        show_ratio(f"{self.kind}: compress CPU s per GiB", self.codec(0), "<= 2.5, one core")
        show_ratio(f"{self.kind}: decompress CPU s per GiB", self.codec(1), "<= 1.5, one core")


def bench_compression(size_gib: float, ranks: int, root: Path, repeat: int) -> None:
    """Bucket bytes, upload and download time with and without zstd, and its CPU, against moto."""
    try:
        import boto3  # noqa: F401
    except ImportError:
        print("  skipped: needs boto3 and moto (pip install -e '.[bench]')")
        return
    total, measured = int(size_gib * 2**30), []
    with moto_server() as (endpoint, client, options):
        for number, kind in enumerate(KINDS):
            source = root / f"compression-{number}"
            states = [_state(kind, total, ranks, rank) for rank in range(ranks)]
            manifest = save_sharded(states, source / step_dir_name(1), step=1)
            del states
            measured.append(_Measured(kind, manifest.total_bytes / 2**30))
            for run in range(repeat):
                measured[-1].cpu += _codec_cpu(source / step_dir_name(1), manifest)
                measured[-1].rounds.append(
                    {
                        mode: _round(
                            f"tiered-zstd-{number}-{run}-{mode}",
                            client,
                            options,
                            source,
                            manifest,
                            mode,
                            root / "compression-download",
                        )  # fmt: skip
                        for mode in MODES
                    }
                )
                urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")).read()
            clear(source)
            print(measured[-1].describe(ranks))
    print("  moto S3 server on loopback (it shares the CPUs), each state's rounds interleaved; ratios (target):")
    for each in measured:
        each.print_ratios(KINDS[each.kind])


def _push(store: Any, uploader: Any, step: int) -> None:
    """Upload ``step`` through ``uploader`` and wait for it; its failure, if any, raised."""
    from tiered_ckpt import maintenance

    maintenance.push(store, uploader, step)
    uploader.errors.raise_first()
