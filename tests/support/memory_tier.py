"""A tier in memory, for tests: the smallest implementation of the tier protocol.

It holds shards and manifests in dicts; it is what the contract tests run on first, and
what a store with more tiers than a disk and a bucket is tried with. Not durable, not
shared between nodes, unless told so. Given a ``directory`` (on a memory file system, such
as /dev/shm or a test's tmp), its dicts are files there, which every process naming the
directory shares and which outlive a killed process: a memory server such as Redis,
standing outside the job (tests/test_extra_tiers.py).
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
import uuid
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from pathlib import Path
from typing import BinaryIO, TypeVar

import xxhash

from tiered_ckpt.errors import CheckpointExistsError, IncompleteCheckpointError, ManifestError
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord
from tiered_ckpt.io.hashing import ShardDigest, Verify
from tiered_ckpt.tiers.base import Capabilities, Landed, ShardSource

T = TypeVar("T")


def digest_of(data: bytes) -> ShardDigest:
    return ShardDigest(len(data), hashlib.sha256(data).hexdigest(), xxhash.xxh3_64_hexdigest(data))


K = TypeVar("K")


class _Files(MutableMapping[K, bytes]):
    """A dict whose entries are files in ``directory``, each written whole under a temp name and
    renamed: every process naming the directory sees the same entries, never a half-written one."""

    def __init__(self, directory: Path, name: Callable[[K], str], key: Callable[[str], K]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._directory, self._name, self._key = directory, name, key

    def __getitem__(self, key: K) -> bytes:
        try:
            return (self._directory / self._name(key)).read_bytes()
        except FileNotFoundError:
            raise KeyError(key) from None

    def __setitem__(self, key: K, data: bytes) -> None:
        temp = self._directory / f".{uuid.uuid4().hex}"
        temp.write_bytes(data)
        os.replace(temp, self._directory / self._name(key))

    def __delitem__(self, key: K) -> None:
        try:
            (self._directory / self._name(key)).unlink()
        except FileNotFoundError:
            raise KeyError(key) from None

    def __iter__(self) -> Iterator[K]:
        return iter([self._key(name) for name in sorted(os.listdir(self._directory)) if not name.startswith(".")])

    def __len__(self) -> int:
        return len(list(iter(self)))


def _shard_name(key: tuple[int, str]) -> str:
    return f"{key[0]}-{key[1]}"


def _shard_key(name: str) -> tuple[int, str]:
    step, path = name.split("-", 1)
    return int(step), path


class MemoryTier:
    """Checkpoints in a dict; ``name`` and ``capabilities`` as a test needs them."""

    def __init__(
        self, name: str = "memory", *, durable: bool = False, shared: bool = False, directory: Path | None = None
    ) -> None:
        self.name = name
        self.url = f"memory://{name}"
        self.capabilities = Capabilities(
            durable=durable, shared=shared, create_only_commit=True, store_checksums=False, ranged_reads=True
        )
        self.shards: MutableMapping[tuple[int, str], bytes] = {}
        self.manifests: MutableMapping[int, bytes] = {}
        if directory is not None:
            self.shards = _Files(directory / "shards", _shard_name, _shard_key)
            self.manifests = _Files(directory / "manifests", str, int)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"MemoryTier({self.name!r})"

    def steps(self) -> list[int]:
        return sorted(self.manifests)

    def uncommitted_steps(self) -> list[int]:
        return sorted({step for step, _ in self.shards} - set(self.manifests))

    def list_steps(self, *, once: bool = False) -> tuple[list[int], list[int]]:
        with self._lock:
            return self.steps(), self.uncommitted_steps()

    def held_ranks(self, step: int, manifest: ShardManifest) -> tuple[int, ...]:
        """Every rank on a shared tier; on a node-local one, the ranks whose shards landed here."""
        with self._lock:
            held = {path for held_step, path in self.shards if held_step == step}
        return tuple(record.rank for record in manifest.shards if self.capabilities.shared or record.path in held)

    def shard_location(self, step: int, record: ShardRecord) -> str:
        return f"{self.url}/{step}/{record.path}"

    def manifest(self, step: int) -> ShardManifest:
        source = f"{self.name}: step {step}'s manifest"
        if step not in self.manifests:
            raise IncompleteCheckpointError(f"{source}: not committed")
        manifest = ShardManifest.from_json(self.manifests[step], source=source)
        if manifest.step != step:
            raise ManifestError(f"{source}: field 'step' is {manifest.step}")
        return manifest

    def _data(self, step: int, record: ShardRecord) -> bytes:
        try:
            return self.shards[(step, record.path)]
        except KeyError:
            raise IncompleteCheckpointError(f"{self.name}: step {step}, {record.path}: missing") from None

    def open_shard(self, step: int, record: ShardRecord, consume: Callable[[BinaryIO], T]) -> T:
        return consume(io.BytesIO(self._data(step, record)[: record.size_bytes + 1]))

    def read_range_into(
        self, step: int, record: ShardRecord, offset: int, buffer: memoryview, verify: Verify = "full"
    ) -> str:
        data = self._data(step, record)[offset : offset + len(buffer)]
        if len(data) != len(buffer):
            raise IncompleteCheckpointError(f"{self.name}: step {step}, {record.path}: shorter than recorded")
        buffer[:] = data
        return xxhash.xxh3_64_hexdigest(data) if verify == "fast" else hashlib.sha256(data).hexdigest()

    def check_shard(self, step: int, record: ShardRecord) -> str | None:
        data = self.shards.get((step, record.path))
        if data is None:
            return f"{self.name}: step {step}, {record.path}: missing"
        problem = record.mismatch(digest_of(data))
        return f"{self.name}: step {step}, {record.path}: {problem}" if problem else None

    def land_shard(
        self, step: int, record: ShardRecord, source: ShardSource, *, deadline: float | None = None
    ) -> Landed:
        if source.write is not None:
            out = io.BytesIO()
            source.write(out)
            data = out.getvalue()
        else:
            assert source.path is not None
            data = source.path.read_bytes()
        record.verify(digest_of(data), f"{self.name}: step {step}, {record.path}")
        with self._lock:
            self.shards[(step, record.path)] = data
        return Landed.as_is(record)

    def commit(self, manifest: ShardManifest, *, landed: Sequence[Landed] = (), deadline: float | None = None) -> None:
        for record in manifest.shards:
            self._data(manifest.step, record)
        with self._lock:
            if manifest.step in self.manifests:
                if self.manifest(manifest.step).shards != manifest.shards:
                    raise CheckpointExistsError(f"{self.name}: another checkpoint of step {manifest.step} is committed")
                return
            self.manifests[manifest.step] = manifest.to_json().encode()

    def delete_step(self, step: int) -> None:
        with self._lock:
            self.manifests.pop(step, None)
            for key in [key for key in self.shards if key[0] == step]:
                del self.shards[key]
