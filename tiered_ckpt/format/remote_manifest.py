"""The remote manifest: the bucket's commit record of one step, a document of its own.

It holds the step's manifest (the same shard records as the local one) and what only the
bucket knows: when the step was committed, the checksum the store keeps for each object,
each object's name where it is not the shard's, and how each object compressed on its way
there is stored (:mod:`~tiered_ckpt.format.compressed`). Read from a bucket, it is
untrusted input, validated as strictly as the manifest itself (see
:mod:`~tiered_ckpt.format.manifest`); a document without the newer fields (written before
them) reads as objects stored under their own names, uncompressed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tiered_ckpt.errors import ManifestError
from tiered_ckpt.format.compressed import CompressedObject
from tiered_ckpt.format.manifest import MAX_MANIFEST_BYTES, ShardManifest
from tiered_ckpt.format.strict_json import Fields, dump_object, load_object
from tiered_ckpt.io.hashing import STORE_CHECKSUM

__all__ = ["REMOTE_KIND", "RemoteManifest"]

REMOTE_KIND = "tiered-ckpt remote manifest"
_LOCATION = re.compile(r"[0-9a-f]{2}/[^/]+")
_MAPS = ("store_checksums", "locations", "compression")


@dataclass(frozen=True)
class RemoteManifest:
    """The remote tier's commit record of one step: a document separate from the local manifest.

    It holds the same shard records (sizes, sha256s, offsets; each ``path`` is the
    shard's file name) and ``committed_at``, the Unix time at which every shard had been
    uploaded and confirmed. ``store_checksums`` maps a shard's path to the checksum the store
    keeps for its object (``"crc32c:<base64>"``, on S3 with ``-N`` for an object of N parts;
    ``"md5:<base64>"`` on Azure; ``"sha256:<base64>[-N]"`` from earlier versions), for checks without a download; empty
    where the store keeps none. ``locations`` maps a shard's path to its object's name under
    the step's prefix where that is not the path itself (the "hashed" layout: ``"3f/rank-..."``).
    ``compression`` maps a shard's path to how its object is stored where it was compressed
    (its name then ends in ``.zst``); every other object is the shard file as it is. Its
    ``kind`` field keeps it from being read as a local manifest, and the other way round.
    """

    manifest: ShardManifest
    committed_at: float
    store_checksums: Mapping[str, str] = field(default_factory=dict)
    locations: Mapping[str, str] = field(default_factory=dict)
    compression: Mapping[str, CompressedObject] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {record.path: record.size_bytes for record in self.manifest.shards}
        for path, checksum in self.store_checksums.items():
            if path not in sizes or not isinstance(checksum, str) or not STORE_CHECKSUM.fullmatch(checksum):
                raise ManifestError(f"remote manifest: field 'store_checksums': {path!r:.80}: {checksum!r:.80}")
        for path, name in self.locations.items():
            if path not in sizes or not isinstance(name, str) or not _LOCATION.fullmatch(name) or name[3:] != path:
                raise ManifestError(f"remote manifest: field 'locations': {path!r:.80}: {name!r:.80}")
        for path, stored in self.compression.items():
            problem = stored.problem(sizes[path]) if path in sizes else "names no shard of the step"
            if problem is not None:
                raise ManifestError(f"remote manifest: field 'compression': {path!r:.80}: {problem}")

    def to_json(self) -> str:
        """Serialise to the JSON document :meth:`from_json` reads back unchanged (its maps sorted by path)."""
        document: dict[str, Any] = {"kind": REMOTE_KIND, "committed_at": self.committed_at, **self.manifest.to_dict()}
        if self.store_checksums:
            document["store_checksums"] = dict(sorted(self.store_checksums.items()))
        if self.locations:
            document["locations"] = dict(sorted(self.locations.items()))
        if self.compression:
            document["compression"] = {path: stored.to_dict() for path, stored in sorted(self.compression.items())}
        return dump_object(document, "shards")

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "remote manifest") -> RemoteManifest:
        """Parse and validate a remote manifest; ``source`` (a URL) is named in errors."""
        document = load_object(text, source, MAX_MANIFEST_BYTES)
        fields = Fields(document, source, "")
        kind = fields.string("kind")
        if kind != REMOTE_KIND:
            raise ManifestError(f"{source}: field 'kind': expected {REMOTE_KIND!r}, got {kind[:80]!r}")
        committed_at = fields.number("committed_at")
        extras = {key: document.get(key, {}) for key in _MAPS}
        for key, value in extras.items():
            if not isinstance(value, dict):
                raise ManifestError(f"{source}: field '{key}': expected an object")
        rest = {key: value for key, value in document.items() if key not in ("kind", "committed_at", *extras)}
        manifest = ShardManifest.from_dict(rest, source=source)
        compression = {
            path: CompressedObject.from_dict(entry, source=source, prefix=f"compression.{path[:80]}.")
            for path, entry in extras["compression"].items()
        }
        try:
            return cls(manifest, committed_at, extras["store_checksums"], extras["locations"], compression)
        except ManifestError as exc:
            raise ManifestError(f"{source}: {exc}") from None
