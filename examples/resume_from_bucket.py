"""A fresh machine restores the newest checkpoint from the bucket a config names.

    python examples/resume_from_bucket.py --config configs/s3.toml --local-dir /nvme/new-node

Credentials come from the store's usual chain (AWS_* variables or profile,
GOOGLE_APPLICATION_CREDENTIALS). The world size is the one the newest remote step was
saved with (its manifest says). Every shard is downloaded, verified by sha256 while it
streams, and written to the new local directory, which then holds the step too.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import tiered_ckpt
from tiered_ckpt.build import open_remote_tier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--local-dir", help="this machine's local directory (overrides the config)")
    args = parser.parse_args()

    overrides = {"local.dir": args.local_dir} if args.local_dir else {}
    config = tiered_ckpt.load_config(args.config, overrides=overrides)
    if config.remote is None:
        raise SystemExit(f"{args.config} names no [remote] tier to restore from")
    bucket = open_remote_tier(config.remote, config.upload)
    steps = bucket.steps()
    if not steps:
        raise SystemExit(f"{config.remote.url} holds no committed step")
    world_size = bucket.read_manifest(steps[-1]).manifest.world_size  # as the job saved it
    with tiered_ckpt.CheckpointManager.from_config(config, world_size=world_size) as manager:
        result = manager.restore()
    size = result.manifest.total_bytes
    print(f"restored step {result.step} of {world_size} ranks ({size} bytes) into {config.local.dir}")
    print(f"shards from: {result.sources}")


if __name__ == "__main__":
    main()
