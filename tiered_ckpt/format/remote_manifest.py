"""The remote manifest: the bucket's commit record of one step, a document of its own.

It holds the step's manifest (the same shard records as the local one) and what only the
bucket knows: when the step was committed, the checksum the store keeps for each object,
each object's name where it is not the shard's, and how each object compressed on its way
there is stored (:mod:`~tiered_ckpt.format.compressed`), and the same of each earlier step's
object that the step references (an incremental save). Read from a bucket, it is
untrusted input, validated as strictly as the manifest itself (see
:mod:`~tiered_ckpt.format.manifest`); a document without the newer fields (written before
them) reads as objects stored under their own names, uncompressed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from tiered_ckpt.errors import ManifestError
from tiered_ckpt.format.compressed import CompressedObject
from tiered_ckpt.format.layout import parse_step_dir_name, step_dir_name
from tiered_ckpt.format.manifest import MAX_MANIFEST_BYTES, Reference, ShardManifest
from tiered_ckpt.format.strict_json import Fields, dump_object, load_object
from tiered_ckpt.io.hashing import STORE_CHECKSUM

__all__ = ["REMOTE_KIND", "RemoteManifest", "StoredObject", "referenced_key"]

REMOTE_KIND = "tiered-ckpt remote manifest"
_LOCATION = re.compile(r"[0-9a-f]{2}/[^/]+")
_MAPS = ("store_checksums", "locations", "compression", "referenced")


def referenced_key(step: int, path: str) -> str:
    """How :attr:`RemoteManifest.referenced` names the shard file ``path`` of earlier ``step``."""
    return f"{step_dir_name(step)}/{path}"


@dataclass(frozen=True)
class StoredObject:
    """Where an earlier step's shard file that a step references is stored under that step's
    prefix: its object's ``location`` (its own name, or the "hashed" layout's ``"3f/<name>"``)
    and how it is compressed (None: as it is)."""

    location: str
    compression: CompressedObject | None = None

    def to_dict(self) -> dict[str, Any]:
        document: dict[str, Any] = {"location": self.location}
        if self.compression is not None:
            document["compression"] = self.compression.to_dict()
        return document


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
    (its name then ends in ``.zst``); every other object is the shard file as it is.
    ``referenced`` says the same of the earlier steps' files its shards reference (by
    :func:`referenced_key`), which stay under those steps' prefixes (a file not named is stored
    under its own name, as it is). Its
    ``kind`` field keeps it from being read as a local manifest, and the other way round.
    """

    manifest: ShardManifest
    committed_at: float
    store_checksums: Mapping[str, str] = field(default_factory=dict)
    locations: Mapping[str, str] = field(default_factory=dict)
    compression: Mapping[str, CompressedObject] = field(default_factory=dict)
    referenced: Mapping[str, StoredObject] = field(default_factory=dict)

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
        files = {
            referenced_key(ref.step, ref.file.path): ref.file.size_bytes
            for record in self.manifest.shards
            for ref in record.references
        }
        for key, kept in self.referenced.items():
            path = key.partition("/")[2]
            if key not in files:
                problem = "names no file the step references"
            elif not isinstance(kept.location, str) or not (
                kept.location == path or (_LOCATION.fullmatch(kept.location) and kept.location[3:] == path)
            ):
                problem = f"location {kept.location!r:.80}"
            else:
                problem = kept.compression.problem(files[key]) if kept.compression is not None else None
            if problem is not None:
                raise ManifestError(f"remote manifest: field 'referenced': {key!r:.80}: {problem}")

    def referenced_files(self) -> Iterator[tuple[Reference, StoredObject]]:
        """Each reference of the step's shards, with where the file it names is stored."""
        for record in self.manifest.shards:
            for ref in record.references:
                yield ref, self.stored(ref.step, ref.file.path)

    def stored(self, step: int, path: str) -> StoredObject:
        """Where the earlier ``step``'s shard file ``path``, which this step references, is stored."""
        return self.referenced.get(referenced_key(step, path), StoredObject(path))

    def to_json(self) -> str:
        """Serialise to the JSON document :meth:`from_json` reads back unchanged (its maps sorted by path)."""
        document: dict[str, Any] = {"kind": REMOTE_KIND, "committed_at": self.committed_at, **self.manifest.to_dict()}
        if self.store_checksums:
            document["store_checksums"] = dict(sorted(self.store_checksums.items()))
        if self.locations:
            document["locations"] = dict(sorted(self.locations.items()))
        if self.compression:
            document["compression"] = {path: stored.to_dict() for path, stored in sorted(self.compression.items())}
        if self.referenced:
            document["referenced"] = {key: stored.to_dict() for key, stored in sorted(self.referenced.items())}
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
        referenced = {key: _stored_object(key, entry, source) for key, entry in extras["referenced"].items()}
        try:
            maps = extras["store_checksums"], extras["locations"], compression, referenced
            return cls(manifest, committed_at, *maps)
        except ManifestError as exc:
            raise ManifestError(f"{source}: {exc}") from None


def _stored_object(key: str, entry: Any, source: str) -> StoredObject:
    """One entry of a remote manifest's ``referenced`` field, validated (untrusted input)."""
    step_dir, _, path = key.partition("/")
    where = f"referenced.{key[:80]}"
    if parse_step_dir_name(step_dir) is None or not path:
        raise ManifestError(f"{source}: field 'referenced': {key!r:.80} names no step's file")
    if not isinstance(entry, dict):
        raise ManifestError(f"{source}: field '{where}': expected an object")
    fields = Fields(entry, source, f"{where}.")
    fields.reject_unknown({"location", "compression"})
    location = fields.string("location")
    compression = entry.get("compression")
    stored = (
        CompressedObject.from_dict(compression, source=source, prefix=f"{where}.compression.")
        if compression is not None
        else None
    )
    return StoredObject(location, stored)
