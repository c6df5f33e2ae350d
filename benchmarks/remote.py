"""The ``remote`` section of the benchmark: uploads and verified downloads next to boto3's.

A checkpoint goes up to moto's S3 server (its own process, on loopback) through the
remote tier's defaults and comes back verified, and the same shard files go up and down
with boto3's ``upload_file`` / ``download_file``, into a fresh bucket per round; then the
same through the bucket model, a proxy that gives moto S3's limits (slowed to fit this
machine): ``benchmarks/bucket_model.py``. Run
through ``python -m benchmarks`` (``--only remote``; needs moto and boto3: the bench extra).
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    BUCKET_MODEL_SCALE,
    Target,
    Timings,
    make_states,
    modelled_bucket,
    moto_server,
    timed,
)
from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.io.parallel import run_parallel
from tiered_ckpt.oneshot import save_sharded

__all__ = ["BUCKETS", "bench_remote"]

BUCKETS = ("moto", "model")
LAYOUTS = ("flat", "hashed")
# A step pushed, untimed, before the measured one into each fresh bucket: the measured upload
# is a running job's, whose run lease was taken at start-up (`tiered-ckpt push` takes it on
# every call: its upload waits for the lease's requests too).
WARM_UP_STEP, MEASURED_STEP = 1, 2
RANKS_AT_SCALE = 1024  # the job whose share of the bucket's request rates the SlowDown part models
HASHED_PREFIXES = 256  # the prefixes a step's shards spread over, laid out "hashed"


def _remote_run(
    bucket: str,
    client: Any,
    options: dict[str, Any],
    source: Path,
    manifest: ShardManifest,
    target: Path,
    timings: Timings,
) -> None:
    """One run of the remote benchmark: ours and boto3's, up and down, into one fresh bucket."""
    from tiered_ckpt.tiers.local import LocalTier
    from tiered_ckpt.tiers.remote.tier import RemoteTier
    from tiered_ckpt.tiers.store import TieredStore

    timings.record("tiered_ckpt upload", _upload(bucket, client, options, source, manifest, "flat"))
    tier = RemoteTier(f"s3://{bucket}/ours", options)
    target_store = TieredStore([LocalTier(target), tier])
    with target_store.local.lock():
        target_store.local.new_step_dir(manifest.step)
        download = functools.partial(target_store.download_shard, manifest.step)
        timings.record("tiered_ckpt download+verify", timed(lambda: run_parallel(download, manifest.shards, None)))
    shard_files = [source / step_dir_name(manifest.step) / record.path for record in manifest.shards]
    timings.record(
        "boto3 upload_file",
        timed(lambda: [client.upload_file(str(path), bucket, f"boto3/{path.name}") for path in shard_files]),
    )
    timings.record(
        "boto3 download_file",
        timed(
            lambda: [
                client.download_file(bucket, f"boto3/{path.name}", str(target / f"boto3-{path.name}"))
                for path in shard_files
            ]
        ),
    )
    shutil.rmtree(target)


def bench_remote(
    size_gib: float, ranks: int, root: Path, repeat: int, model_module: str, buckets: Sequence[str] = BUCKETS
) -> list[Target]:
    """Upload and download GB/s next to boto3's upload_file/download_file, on each of ``buckets``:
    moto's S3 server as it answers (``"moto"``), and through the bucket model (``"model"``:
    S3's bandwidth a connection, first-byte latency and request rates, slowed
    :data:`~benchmarks.harness.BUCKET_MODEL_SCALE` times; ``model_module`` serves it, see
    ``benchmarks/bucket_model.py``). Returns the ratios as issue 45's item 2 rows (item 7 on bare moto)."""
    try:
        import boto3  # noqa: F401
    except ImportError:
        print("  skipped: needs boto3 and moto (pip install -e '.[bench]')")
        return []
    targets = []
    with moto_server() as (endpoint, moto_client, moto_options):
        source = root / "remote-source"
        save_sharded(make_states(ranks << 20, ranks), source / step_dir_name(WARM_UP_STEP), step=WARM_UP_STEP)
        states = make_states(int(size_gib * 2**30), ranks)
        manifest = save_sharded(states, source / step_dir_name(MEASURED_STEP), step=MEASURED_STEP)
        for kind in buckets:
            with contextlib.ExitStack() as stack:
                client, options, said = moto_client, moto_options, "moto S3 server on loopback"
                if kind == "model":
                    model = stack.enter_context(modelled_bucket(endpoint, model_module))
                    client, options = model.client, model.options
                    said = f"the bucket model (S3 slowed {BUCKET_MODEL_SCALE:g}x: {_figures(model.model)})"
                timings = Timings(manifest.total_bytes)
                for run in range(repeat):
                    bucket = f"tiered-bench-{kind}-{run}"
                    _remote_run(bucket, client, options, source, manifest, root / f"download-{run}", timings)
                    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")).read()
            print(f"  checkpoint {manifest.total_bytes / 2**30:.2f} GiB in {ranks} shards, {said}")
            if kind == "model":
                print(f"  requests the model answered 503 SlowDown: {model.refused}")
            timings.print_rates()
            print(f"ratios, {kind} (target):")
            item = 2 if kind == "model" else 7
            label = f"upload / boto3 upload_file, {kind}"
            value = timings.print_ratio(label, "tiered_ckpt upload", "boto3 upload_file", ">= 1.0")
            targets.append(Target(item, label, value, 1.0))
            label = f"download+verify / boto3 download_file, {kind}"
            value = timings.print_ratio(label, "tiered_ckpt download+verify", "boto3 download_file", ">= 1.0")
            targets.append(Target(item, label, value, 1.0))
        if "model" in buckets:
            targets += _slowdown(endpoint, model_module, source, manifest, ranks, repeat)
    return targets


def _upload(
    bucket: str, client: Any, options: dict[str, Any], source: Path, manifest: ShardManifest, layout: str
) -> float:
    """The seconds of one upload of ``manifest``'s step through the remote tier's defaults (its
    object keys laid out as ``layout`` says) into ``bucket``, made fresh, after an untimed upload of
    :data:`WARM_UP_STEP` by the same uploader (as a job's later steps go up: its lease held)."""
    from tiered_ckpt.engine.replication import Replicator
    from tiered_ckpt.tiers.local import LocalTier
    from tiered_ckpt.tiers.remote.tier import RemoteTier
    from tiered_ckpt.tiers.store import TieredStore

    client.create_bucket(Bucket=bucket)
    tier = RemoteTier(f"s3://{bucket}/ours", options, layout=layout)  # type: ignore[arg-type]
    store = TieredStore([LocalTier(source), tier])
    with store.local.lock(), contextlib.closing(Replicator(store)) as uploader:
        _push(store, uploader, WARM_UP_STEP)
        return timed(lambda: _push(store, uploader, manifest.step))


def _slowdown(
    endpoint: str, model_module: str, source: Path, manifest: ShardManifest, ranks: int, repeat: int
) -> list[Target]:
    """Uploads against the bucket model with each prefix's request rates as the ranks of a job of
    :data:`RANKS_AT_SCALE` meet them, next to the same uploads without the rate limit, keys laid
    out flat and hashed, interleaved. Laid out flat, every rank's shard of a step is under one
    prefix: this run's ranks have ``ranks / RANKS_AT_SCALE`` of its rates. Hashed, a step's
    shards spread over :data:`HASHED_PREFIXES` prefixes: at scale each holds
    ``RANKS_AT_SCALE / HASHED_PREFIXES`` ranks' shards, here one's (for as many ranks as prefixes),
    so a rank has that share of its prefix's rates."""
    shares = {
        "flat": ranks / RANKS_AT_SCALE,
        "hashed": max(1, ranks / HASHED_PREFIXES) * HASHED_PREFIXES / RANKS_AT_SCALE,
    }
    with contextlib.ExitStack() as stack:
        free = stack.enter_context(modelled_bucket(endpoint, model_module, rate_limit=False))
        limited = {
            layout: stack.enter_context(modelled_bucket(endpoint, model_module, rate_share=min(1.0, shares[layout])))
            for layout in LAYOUTS
        }
        timings = Timings(manifest.total_bytes)
        for run in range(repeat):
            for layout in LAYOUTS:
                for name, model in (("rate-limited", limited[layout]), ("no rate limit", free)):
                    bucket = f"slowdown-{layout}-{'free' if model is free else 'limited'}-{run}"
                    seconds = _upload(bucket, model.client, model.options, source, manifest, layout)
                    timings.record(f"upload, {layout} keys, {name}", seconds)
            urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")).read()
    print(
        f"  the same checkpoint through the bucket model, its rates as {RANKS_AT_SCALE} ranks meet them, and without:"
    )
    for layout in LAYOUTS:
        model = limited[layout]
        print(f"    {layout} keys: {_figures(model.model)}; answered 503 SlowDown: {model.refused}")
    timings.print_rates()
    print("ratios, 503 SlowDown (target):")
    targets = []
    for layout in LAYOUTS:
        limited_name, free_name = f"upload, {layout} keys, rate-limited", f"upload, {layout} keys, no rate limit"
        label = f"upload with SlowDown / without, {layout} keys"
        value = timings.print_paired_ratio(label, limited_name, free_name, ">= 0.9")
        targets.append(Target(2, label, value, 0.9))
    return targets


def _figures(model: dict[str, Any]) -> str:
    """The model's figures, as a line says them."""
    rates = (
        "no rate limit"
        if model["writes"] is None
        else f"{model['writes']:g} writes, {model['reads']:g} reads/s a prefix"
    )
    return f"{model['bandwidth'] / 1e6:g} MB/s a connection, {model['latency'] * 1e3:g} ms to the first byte, {rates}"


def _push(store: Any, uploader: Any, step: int) -> None:
    """Upload ``step`` through ``uploader`` and wait for it; its failure, if any, raised."""
    from tiered_ckpt import maintenance

    maintenance.push(store, uploader, step)
    uploader.errors.raise_first()
