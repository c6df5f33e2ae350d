"""The file-system backend (a plain path or ``file://``: NFS, Lustre ...).

Objects land by temp name, fsync and rename, parent directories created; a small object
written create-only is linked into place (see :func:`~tiered_ckpt.io.durable.atomic_write`),
so a commit never replaces another. A step is deleted as one directory tree.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

from tiered_ckpt.format.manifest import ShardRecord
from tiered_ckpt.io.durable import atomic_write, write_bytes
from tiered_ckpt.io.hashing import copy_and_hash
from tiered_ckpt.tiers.remote.backends.base import Sent
from tiered_ckpt.tiers.remote.backends.fsspec import FsspecBackend

__all__ = ["PosixBackend"]


class PosixBackend(FsspecBackend):
    """A directory on a file system this node mounts."""

    capabilities = replace(FsspecBackend.capabilities, create_only_commit=True)  # a link never replaces a file

    def put_shard(self, local_path: Path, path: str, record: ShardRecord, *, deadline: float | None) -> Sent:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        what = f"{self.url}/{path[len(self.root) :].lstrip('/')} from {local_path}"
        # By size and xxh3-64, as every backend checks a file before it is an object: a compressed
        # object's record keeps the sha256 of the shard inside, not of the object's bytes.
        with open(local_path, "rb") as source:
            atomic_write(
                target,
                lambda out: copy_and_hash(source, out),
                check=lambda d: record.verify(replace(d, sha256=""), what),
            )
        return Sent(None)

    def put_bytes(self, path: str, data: bytes, *, create_only: bool = False, timeout: float | None = None) -> None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(target, data, create_only=create_only)

    def delete_prefix(self, prefix: str) -> None:
        if Path(prefix).is_dir():
            shutil.rmtree(prefix)
