"""The manifest: what a committed checkpoint holds, as frozen dataclasses with strict JSON.

A manifest read from disk or a bucket is untrusted input. :meth:`ShardManifest.from_json`
accepts only a document this library could have written: known schema version, every
field present with the right type, no unknown fields, ranks ``0..world_size-1`` each
once, plain shard file names, and parameter offsets that tile the flat parameter vector
in rank order. Anything else raises :class:`ManifestError` naming the file and field.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import InitVar, dataclass
from typing import Any

from tiered_ckpt.errors import ChecksumMismatchError, ManifestError, ShardCountMismatchError
from tiered_ckpt.format.layout import MANIFEST_NAME, is_plain_name, is_shard_name
from tiered_ckpt.format.metrics import Metrics, parse_metrics
from tiered_ckpt.format.shardfile import DTYPES, MAX_DIMS, MAX_HEADER_BYTES, json_length_bound
from tiered_ckpt.format.strict_json import Fields, dump_object, load_object
from tiered_ckpt.io.gc_pause import cyclic_gc_paused
from tiered_ckpt.io.hashing import ShardDigest

__all__ = [
    "SCHEMA_VERSION",
    "REFERENCES_SCHEMA_VERSION",
    "METRICS_SCHEMA_VERSION",
    "MAX_REFERENCED_FILES",
    "READABLE_SCHEMA_VERSIONS",
    "ChunkRecord",
    "Reference",
    "ShardRecord",
    "ShardManifest",
    "MAX_MANIFEST_BYTES",
    "record_bytes_bound",
    "records_array_digests",
    "references_fit",
    "manifest_problem",
]

# Version 2: shards carry the structure document of a nested state (format/structure.py),
# and a shard record may list the DTensor chunks its shard holds ("chunks"). Version 3: a
# shard record may reference arrays an earlier step's file holds ("references"); a manifest
# with none is still written as version 2, which releases that know no references read.
# Version 1 (flat states, no structure documents) was never released: it is refused, as is
# any version a later release writes, rather than misread. Version 4: a manifest may record
# the step's metrics ("metrics", format/metrics.py), and is written as version 4 only then.
SCHEMA_VERSION = 2
REFERENCES_SCHEMA_VERSION = 3
METRICS_SCHEMA_VERSION = 4
READABLE_SCHEMA_VERSIONS = (2, 3, 4)
# Bounds what a hostile manifest can make us allocate; 10**5 ranks take ~30 MB. A save
# whose manifest might not fit is refused up front (manifest_problem): a step that saves loads.
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
# At least what to_json (indented, as it was written before) and a remote manifest's entries take, measured: a shard
# record with its fields; one chunk record (or replica) besides its name; one dimension in
# each of a chunk's three lists; the manifest's own fields.
_RECORD_BYTES = 1024
_CHUNK_BYTES = 260
_DIM_BYTES = 90
_MANIFEST_BYTES = 4096

# Per-array xxh3-64s take 16 bytes per array: recorded only while all ranks' take at most
# this much of a manifest, so a step that saved before still saves.
_ARRAY_DIGESTS_BYTES = MAX_MANIFEST_BYTES // 4
# The earlier files one shard may reference: past it, a save writes its arrays again, so that
# a restore reads a bounded number of files per shard and a manifest stays small.
MAX_REFERENCED_FILES = 16
_SHA256 = re.compile(r"[0-9a-f]{64}")
_ARRAY_XXH3 = re.compile(r"(?:[0-9a-f]{16})*")
_XXH3_64 = re.compile(r"[0-9a-f]{16}")
_RESERVED_KEY = "__metadata__"


@dataclass(frozen=True)
class ChunkRecord:
    """One array of a state of DTensors, as a chunk: the shard's array ``name`` (of
    safetensors dtype code ``dtype``) is the box of the global tensor (``global_shape``)
    that starts at ``offsets`` and spans ``sizes`` (a plain array is the one chunk of
    itself); ``sha256`` (and ``xxh3_64``, for ``verify="fast"``; empty in manifests written
    before it) is over the array's bytes, so that a reader of only this chunk verifies what
    it read."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    sha256: str
    xxh3_64: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The record as the manifest's JSON holds it (every field, read back as it was)."""
        return {
            "name": self.name,
            "dtype": self.dtype,
            "global_shape": list(self.global_shape),
            "offsets": list(self.offsets),
            "sizes": list(self.sizes),
            "sha256": self.sha256,
            **({"xxh3_64": self.xxh3_64} if self.xxh3_64 else {}),
        }


@dataclass(frozen=True)
class Reference:
    """Arrays of a rank's state that a shard leaves out because an earlier step's file already
    holds their bytes (an incremental save): ``names`` (sorted) of the shard file ``file`` of
    step ``step``, whose record is the one the step that wrote it recorded (its whole-file
    digests and its header's, without per-array digests), and ``xxh3_64``: each of those
    arrays' xxh3-64 (16 hex digits each, in the order of ``names``); ``bytes``: their size
    together. With them a reader verifies the header and each array it reads from the file
    without that step's manifest, which retention may have deleted (the file stays while a
    retained step references it)."""

    step: int
    file: ShardRecord
    names: tuple[str, ...]
    xxh3_64: str
    bytes: int

    def digests(self) -> dict[str, str]:
        """By name, the xxh3-64 of each array referenced."""
        return {name: self.xxh3_64[16 * i : 16 * i + 16] for i, name in enumerate(self.names)}

    def to_dict(self) -> dict[str, Any]:
        """The reference as the manifest's JSON holds it."""
        return {
            "step": self.step,
            "file": self.file.to_dict(),
            "names": list(self.names),
            "xxh3_64": self.xxh3_64,
            "bytes": self.bytes,
        }


@dataclass(frozen=True)
class ShardRecord:
    """One rank's shard file as the manifest records it.

    ``param_shard_offset`` / ``param_shard_numel`` place this rank's slice in the flat
    parameter vector: the slice is the common length of the rank's sharded 1-D arrays,
    and the slices of ranks ``0..world_size-1`` follow each other without gaps.
    ``sha256`` and ``xxh3_64`` are over the whole file's bytes; ``header_bytes`` /
    ``header_sha256`` measure the file's header (where the arrays are, and the structure
    document; 0 and "" in manifests written before them). For a state of DTensors,
    ``chunks`` lists every array of the shard with its own sha256: with them a reader
    verifies the parts of the file it reads without reading all of it. ``replicas`` lists
    the replicated arrays of this rank's state that its shard leaves out, because another
    rank (their writer) stores them, as ``(name, writer rank)`` pairs (the writer's record
    has the array among its ``chunks``; see :mod:`tiered_ckpt.dist.replicas`).
    ``array_xxh3_64``: in a shard of plain arrays, each array's xxh3-64 (16 hex digits, in
    sorted name order; "" if not recorded, :func:`records_array_digests`): with it and the
    header's sha256, a reader of some arrays verifies what it read (:meth:`array_digests`).
    ``references``: the arrays of the rank's state its shard leaves out because earlier
    steps' files hold them (:class:`Reference`; an incremental save); the shard's structure
    document still names them.
    """

    rank: int
    path: str
    sha256: str
    xxh3_64: str
    size_bytes: int
    param_shard_offset: int
    param_shard_numel: int
    chunks: tuple[ChunkRecord, ...] = ()
    header_bytes: int = 0
    header_sha256: str = ""
    replicas: tuple[tuple[str, int], ...] = ()
    array_xxh3_64: str = ""
    references: tuple[Reference, ...] = ()

    @property
    def elsewhere(self) -> frozenset[str]:
        """The arrays its structure document names that its shard file leaves out: those it left
        to other ranks' shards (``replicas``) and those it references in earlier steps' files."""
        return frozenset(
            [name for name, _writer in self.replicas] + [name for ref in self.references for name in ref.names]
        )

    @property
    def referenced(self) -> dict[str, Reference]:
        """By name, the reference of each array whose bytes an earlier step's file holds."""
        return {name: ref for ref in self.references for name in ref.names}

    def check_holds(self, names: Iterable[str], what: str) -> None:
        """Raise :class:`ManifestError` naming ``what`` (the shard file) if it holds an array
        (``names``: those its verified header lists) that the record references elsewhere."""
        if self.references:
            both = self.referenced.keys() & set(names)
            if both:
                raise ManifestError(f"{what}: holds {min(both)!r:.80}, which its manifest record references elsewhere")

    def array_digests(self, names: Iterable[str]) -> dict[str, str]:
        """By name, the xxh3-64 ``array_xxh3_64`` records for the shard's arrays ``names`` (all of
        them, from its verified header; {} if it records none); :class:`ManifestError` if not one each."""
        ordered, digests = sorted(names), self.array_xxh3_64
        if digests and len(digests) != 16 * len(ordered):
            count = f"{len(digests) // 16} digests for a shard of {len(ordered)} arrays"
            raise ManifestError(f"rank {self.rank}'s record: field 'array_xxh3_64' holds {count}")
        return {name: digests[16 * i : 16 * i + 16] for i, name in enumerate(ordered)} if digests else {}

    def digests_by_name(self, names: Iterable[str]) -> dict[str, str]:
        """By name, the digest the record holds for each array of its shard (``names``: all of
        them, from its header, the arrays it references included), as ``"sha256:<hex>"`` (a
        chunk of a state of DTensors) or ``"xxh3_64:<hex>"`` (a shard of plain arrays); the
        arrays it records none for are left out. Raises as :meth:`array_digests` does."""
        if self.chunks:
            return {chunk.name: f"sha256:{chunk.sha256}" for chunk in self.chunks if chunk.sha256}
        referenced = self.referenced
        own = self.array_digests(name for name in names if name not in referenced)
        for ref in self.references:
            own.update(ref.digests())
        return {name: f"xxh3_64:{digest}" for name, digest in own.items()}

    @classmethod
    def from_dict(cls, document: Mapping[str, Any], *, source: str = "shard record") -> ShardRecord:
        """Validate a parsed JSON shard record (what :meth:`to_dict` made); errors name ``source``."""
        return _parse_record(document, source, "")

    def mismatch(self, digest: ShardDigest) -> str | None:
        """How bytes with ``digest`` differ from this record, or None if they match.

        The one comparison of a file, a stream or an object with its record: every tier
        calls it. A checksum the digest leaves empty (not computed) is not compared.
        """
        if digest.size_bytes != self.size_bytes:
            return f"{digest.size_bytes} bytes, the manifest records {self.size_bytes}"
        if digest.sha256 and digest.sha256 != self.sha256:
            return f"sha256 is {digest.sha256}, the manifest records {self.sha256}"
        if digest.xxh3_64 and digest.xxh3_64 != self.xxh3_64:
            return f"xxh3_64 is {digest.xxh3_64}, the manifest records {self.xxh3_64}"
        return None

    def verify(self, digest: ShardDigest, what: str) -> None:
        """Raise :class:`ChecksumMismatchError` naming ``what`` unless :meth:`mismatch` finds nothing."""
        problem = self.mismatch(digest)
        if problem is not None:
            raise ChecksumMismatchError(f"{what}: {problem}")

    def to_dict(self) -> dict[str, Any]:
        """The record as the manifest's JSON holds it (its optional fields only when set)."""
        return {
            "rank": self.rank,
            "path": self.path,
            "sha256": self.sha256,
            "xxh3_64": self.xxh3_64,
            "size_bytes": self.size_bytes,
            "param_shard_offset": self.param_shard_offset,
            "param_shard_numel": self.param_shard_numel,
            **({"chunks": [chunk.to_dict() for chunk in self.chunks]} if self.chunks else {}),
            **({"header_bytes": self.header_bytes, "header_sha256": self.header_sha256} if self.header_bytes else {}),
            **({"replicas": [[name, writer] for name, writer in self.replicas]} if self.replicas else {}),
            **({"array_xxh3_64": self.array_xxh3_64} if self.array_xxh3_64 else {}),
            **({"references": [ref.to_dict() for ref in self.references]} if self.references else {}),
        }


@dataclass(frozen=True)
class ShardManifest:
    """A committed checkpoint of ``world_size`` shards taken at training step ``step``.

    ``wall_clock_seconds`` is the Unix time at which the checkpoint was committed.
    ``sharded_keys`` names the arrays that are slices of the flat parameter vector
    (the rest are replicated). ``shards`` is ordered by rank. ``metrics`` are the numbers
    the save recorded (:mod:`~tiered_ckpt.format.metrics`), sorted by name. Constructing a
    manifest validates it; an inconsistent one raises :class:`ManifestError`.
    """

    world_size: int
    step: int
    wall_clock_seconds: float
    sharded_keys: tuple[str, ...]
    shards: tuple[ShardRecord, ...]
    schema_version: int = SCHEMA_VERSION
    metrics: Metrics = ()
    source: InitVar[str] = "manifest"

    def __post_init__(self, source: str) -> None:
        _check_manifest(self, source)

    def shard(self, rank: int) -> ShardRecord:
        """Return the record of ``rank``."""
        return self.shards[rank]

    def metric(self, name: str) -> float | None:
        """The value the save recorded for metric ``name`` (None: none, or not a finite number)."""
        return dict(self.metrics).get(name)

    @property
    def total_bytes(self) -> int:
        """Bytes of all shard files together: the bytes the step owns (the arrays its shards
        reference in earlier steps' files are :attr:`referenced_bytes`)."""
        return sum(record.size_bytes for record in self.shards)

    @property
    def referenced_bytes(self) -> int:
        """Bytes of the arrays the shards reference in earlier steps' files (not their own)."""
        return sum(ref.bytes for record in self.shards for ref in record.references)

    @property
    def total_numel(self) -> int:
        """Length of the flat parameter vector the shards slice."""
        return sum(record.param_shard_numel for record in self.shards)

    def shards_digest(self) -> str:
        """The sha256 of the shard records (as the manifest's JSON holds them): equal for two
        manifests whose records are equal, whatever else differs (when each was committed)."""
        with cyclic_gc_paused():  # a dict per rank: see io/gc_pause.py
            records = json.dumps([record.to_dict() for record in self.shards], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(records.encode()).hexdigest()

    def to_json(self) -> str:
        """Serialise to the JSON document :meth:`from_json` reads back unchanged."""
        with cyclic_gc_paused():  # a dict per rank, all alive until written: see io/gc_pause.py
            return dump_object(self.to_dict(), "shards")

    def to_dict(self) -> dict[str, Any]:
        """The manifest as a JSON object (what :meth:`to_json` writes and :meth:`from_dict` reads)."""
        return {
            "schema_version": self.schema_version,
            "world_size": self.world_size,
            "step": self.step,
            "wall_clock_seconds": self.wall_clock_seconds,
            "sharded_keys": list(self.sharded_keys),
            "shards": [record.to_dict() for record in self.shards],
            **({"metrics": dict(self.metrics)} if self.metrics else {}),
        }

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "manifest") -> ShardManifest:
        """Parse and validate a manifest; ``source`` (a path or URL) is named in errors."""
        with cyclic_gc_paused():  # a dict, then a record, per rank: see io/gc_pause.py
            return cls.from_dict(load_object(text, source, MAX_MANIFEST_BYTES), source=source)

    @classmethod
    def from_dict(cls, document: Mapping[str, Any], *, source: str = "manifest") -> ShardManifest:
        """Validate a parsed JSON document as a manifest; ``source`` is named in errors."""
        fields = Fields(document, source, "")
        fields.reject_unknown(
            {"schema_version", "world_size", "step", "wall_clock_seconds", "sharded_keys", "shards", "metrics"}
        )
        version = fields.integer("schema_version", minimum=0)
        if version not in READABLE_SCHEMA_VERSIONS:
            raise ManifestError(
                f"{source}: field 'schema_version': unsupported version {version} "
                f"(this library reads versions {', '.join(map(str, READABLE_SCHEMA_VERSIONS))})"
            )
        shards = fields.list_of("shards", Mapping)
        with cyclic_gc_paused():  # a record per rank, all alive until returned: see io/gc_pause.py
            return cls(
                world_size=fields.integer("world_size", minimum=1),
                step=fields.integer("step", minimum=0),
                wall_clock_seconds=fields.number("wall_clock_seconds"),
                sharded_keys=tuple(fields.list_of("sharded_keys", str)),
                shards=tuple(
                    sorted(
                        (_parse_record(shard, source, f"shards[{i}].") for i, shard in enumerate(shards)),
                        key=lambda record: record.rank,
                    )
                ),
                schema_version=version,
                metrics=parse_metrics(document["metrics"], source) if "metrics" in document else (),
                source=source,
            )


def record_bytes_bound(chunks: Iterable[tuple[str, int]] = ()) -> int:
    """At least the bytes one rank's shard record adds to a step's manifest, local or remote
    (as :meth:`ShardManifest.to_json` writes it), whose shard lists ``chunks``: the name and
    number of dimensions of each array it records as a chunk, or leaves to another rank."""
    return _RECORD_BYTES + sum(_CHUNK_BYTES + json_length_bound(name) + _DIM_BYTES * ndim for name, ndim in chunks)


def records_array_digests(arrays: int, world_size: int) -> bool:
    """Whether a plain shard of ``arrays`` arrays in a step of ``world_size`` ranks records each
    array's xxh3-64 (:attr:`ShardRecord.array_xxh3_64`; see :data:`_ARRAY_DIGESTS_BYTES`)."""
    return world_size * arrays * 16 <= _ARRAY_DIGESTS_BYTES


def references_fit(name_bytes: int, arrays: int, world_size: int) -> bool:
    """Whether a plain shard of ``arrays`` arrays whose names take ``name_bytes`` (as JSON, each
    :func:`~tiered_ckpt.format.shardfile.json_length_bound`) may reference earlier files, in a
    step of ``world_size`` ranks: while every rank's references, all of its arrays referenced
    from up to :data:`MAX_REFERENCED_FILES` files, take at most a quarter of a manifest."""
    per_rank = name_bytes + arrays * (16 + 2) + MAX_REFERENCED_FILES * _RECORD_BYTES
    return world_size * per_rank <= _ARRAY_DIGESTS_BYTES


def manifest_problem(records: Iterable[int], sharded_keys: Iterable[str], metrics: Metrics = ()) -> str | None:
    """Why the manifest of a step whose shard records take at most ``records`` bytes each
    (:func:`record_bytes_bound`), with ``metrics``, might not be read back, as a phrase; None if it will."""
    bound = _MANIFEST_BYTES + sum(records) + sum(json_length_bound(key) + 8 for key in sharded_keys)
    bound += sum(json_length_bound(name) + 32 for name, _value in metrics)
    if bound > MAX_MANIFEST_BYTES:
        return f"may take up to {bound:,} bytes, over the {MAX_MANIFEST_BYTES:,} a reader accepts"
    return None


def _parse_reference(document: Mapping[str, Any], source: str, prefix: str) -> Reference:
    fields = Fields(document, source, prefix)
    fields.reject_unknown({"step", "file", "names", "xxh3_64", "bytes"})
    file = document.get("file")
    if not isinstance(file, Mapping):
        raise ManifestError(f"{source}: field '{prefix}file': expected an object")
    return Reference(
        step=fields.integer("step", minimum=0),
        file=_parse_record(file, source, f"{prefix}file.", nested=True),
        names=tuple(fields.list_of("names", str)),
        xxh3_64=fields.string("xxh3_64"),
        bytes=fields.integer("bytes", minimum=0),
    )


def _parse_record(document: Mapping[str, Any], source: str, prefix: str, *, nested: bool = False) -> ShardRecord:
    fields = Fields(document, source, prefix)
    fields.reject_unknown(
        {"rank", "path", "sha256", "xxh3_64", "size_bytes", "param_shard_offset", "param_shard_numel"}
        | {"chunks", "header_bytes", "header_sha256", "replicas", "array_xxh3_64", "references"}
    )
    array_xxh3 = fields.string("array_xxh3_64") if "array_xxh3_64" in document else ""
    if not _ARRAY_XXH3.fullmatch(array_xxh3) or (array_xxh3 and "header_bytes" not in document):
        problem = "not 16 lowercase hex digits per array, with the header's digest recorded beside it"
        raise ManifestError(f"{source}: field '{prefix}array_xxh3_64': {problem}")
    chunks = fields.list_of("chunks", Mapping) if "chunks" in document else []
    replicas = fields.list_of("replicas", list) if "replicas" in document else []
    references = fields.list_of("references", Mapping) if "references" in document and not nested else []
    if nested and "references" in document:
        raise ManifestError(f"{source}: field '{prefix}references': a referenced file references nothing")
    return ShardRecord(
        references=tuple(
            _parse_reference(item, source, f"{prefix}references[{i}].") for i, item in enumerate(references)
        ),
        replicas=tuple(_parse_replica(item, source, f"{prefix}replicas[{i}]") for i, item in enumerate(replicas)),
        array_xxh3_64=array_xxh3,
        header_bytes=fields.integer("header_bytes", minimum=8) if chunks or "header_bytes" in document else 0,
        header_sha256=fields.string("header_sha256") if chunks or "header_bytes" in document else "",
        chunks=tuple(_parse_chunk(chunk, source, f"{prefix}chunks[{i}].") for i, chunk in enumerate(chunks)),
        rank=fields.integer("rank", minimum=0),
        path=fields.string("path"),
        sha256=fields.string("sha256"),
        xxh3_64=fields.string("xxh3_64"),
        size_bytes=fields.integer("size_bytes", minimum=0),
        param_shard_offset=fields.integer("param_shard_offset", minimum=0),
        param_shard_numel=fields.integer("param_shard_numel", minimum=0),
    )


def _parse_replica(item: list[Any], source: str, field: str) -> tuple[str, int]:
    if len(item) != 2 or type(item[0]) is not str or type(item[1]) is not int:
        raise ManifestError(f"{source}: field '{field}': expected [array name, writer rank], got {str(item)[:80]}")
    return item[0], item[1]


def _parse_chunk(document: Mapping[str, Any], source: str, prefix: str) -> ChunkRecord:
    fields = Fields(document, source, prefix)
    fields.reject_unknown({"name", "dtype", "global_shape", "offsets", "sizes", "sha256", "xxh3_64"})
    dims = {key: fields.list_of(key, int) for key in ("global_shape", "offsets", "sizes")}
    for key, values in dims.items():
        if len(values) > MAX_DIMS or any(isinstance(v, bool) or v < 0 for v in values):
            raise ManifestError(f"{source}: field '{prefix}{key}': at most {MAX_DIMS} integers >= 0")
    return ChunkRecord(
        name=fields.string("name"),
        dtype=fields.string("dtype"),
        global_shape=tuple(dims["global_shape"]),
        offsets=tuple(dims["offsets"]),
        sizes=tuple(dims["sizes"]),
        sha256=fields.string("sha256"),
        xxh3_64=fields.string("xxh3_64") if "xxh3_64" in document else "",
    )


def _check_manifest(manifest: ShardManifest, source: str) -> None:
    def fail(field: str, problem: str) -> ManifestError:
        return ManifestError(f"{source}: field '{field}': {problem}")

    if len(manifest.shards) != manifest.world_size:
        raise ShardCountMismatchError(
            f"{source}: field 'shards': lists {len(manifest.shards)} shards but world_size is {manifest.world_size}"
        )
    if len(set(manifest.sharded_keys)) != len(manifest.sharded_keys):
        raise fail("sharded_keys", "names a key twice")
    if manifest.metrics:
        if manifest.schema_version < METRICS_SCHEMA_VERSION:
            raise fail("metrics", f"metrics need schema_version {METRICS_SCHEMA_VERSION}")
        if parse_metrics(dict(manifest.metrics), source) != manifest.metrics:  # sorted, each name once
            raise fail("metrics", "must be (name, value) pairs sorted by name, each name once")
    for key in manifest.sharded_keys:
        if not key or key == _RESERVED_KEY:
            raise fail("sharded_keys", f"invalid key {key!r}")
    seen_paths: set[str] = set()
    expected_offset = 0
    for index, record in enumerate(manifest.shards):
        where = f"shards[rank {record.rank}]"
        if record.rank != index:
            missing = sorted(set(range(manifest.world_size)) - {r.rank for r in manifest.shards})
            raise fail(f"{where}.rank", f"ranks must be 0..{manifest.world_size - 1} each once; missing {missing}")
        if not is_plain_name(record.path) or record.path == MANIFEST_NAME:
            raise fail(f"{where}.path", f"{record.path!r} is not a plain file name inside the checkpoint")
        if record.path in seen_paths:
            raise fail(f"{where}.path", f"{record.path!r} is used by two ranks")
        seen_paths.add(record.path)
        if not _SHA256.fullmatch(record.sha256):
            raise fail(f"{where}.sha256", f"expected 64 lowercase hex digits, got {record.sha256[:80]!r}")
        if not _XXH3_64.fullmatch(record.xxh3_64):
            raise fail(f"{where}.xxh3_64", f"expected 16 lowercase hex digits, got {record.xxh3_64[:80]!r}")
        for name in ("size_bytes", "param_shard_offset", "param_shard_numel"):
            if getattr(record, name) < 0:
                raise fail(f"{where}.{name}", "must be >= 0")
        if record.param_shard_offset != expected_offset:
            raise fail(
                f"{where}.param_shard_offset",
                f"is {record.param_shard_offset} but the previous ranks' slices end at {expected_offset}",
            )
        expected_offset += record.param_shard_numel
        _check_chunks(record, f"{where}.chunks", fail)
        _check_references(manifest, record, f"{where}.references", fail)
    _check_same_tensors(manifest, fail)
    _check_replicas(manifest, fail)


def _check_references(
    manifest: ShardManifest, record: ShardRecord, where: str, fail: Callable[[str, str], ManifestError]
) -> None:
    """Each reference of a shard names an earlier step's file of the same rank, with the digests a
    reader of its parts needs, and names each array once, none its shard holds nor another
    rank's shard (a replica), each a chunk of a shard of DTensors (whose record gives its box)."""
    if record.references and manifest.schema_version < REFERENCES_SCHEMA_VERSION:
        raise fail(where, f"references need schema_version {REFERENCES_SCHEMA_VERSION}")
    chunks = {chunk.name for chunk in record.chunks}
    replicas = {name for name, _writer in record.replicas}
    if len(record.references) > MAX_REFERENCED_FILES:
        raise fail(where, f"references {len(record.references)} files, over the {MAX_REFERENCED_FILES} a shard may")
    names: set[str] = set()
    files: set[tuple[int, str]] = set()
    for index, ref in enumerate(record.references):
        field, file = f"{where}[{index}]", ref.file
        if not ref.step < manifest.step:
            raise fail(f"{field}.step", f"is {ref.step}, not a step before {manifest.step}")
        if (ref.step, file.path) in files:
            raise fail(f"{field}.file.path", f"step {ref.step}'s {file.path!r:.80} is referenced twice")
        files.add((ref.step, file.path))
        if not is_shard_name(file.path):
            raise fail(f"{field}.file.path", f"{file.path!r:.80} is not a shard file's name")
        if file.rank != record.rank:
            raise fail(f"{field}.file.rank", f"is {file.rank}, not the referencing shard's rank {record.rank}")
        if not (_SHA256.fullmatch(file.sha256) and _XXH3_64.fullmatch(file.xxh3_64)):
            raise fail(f"{field}.file", "needs the file's sha256 and xxh3_64")
        if file.array_xxh3_64 or file.chunks or file.replicas or not file.header_bytes:
            raise fail(f"{field}.file", "a referenced file is a shard of plain arrays with its header's digest")
        _check_chunks(file, f"{field}.file.chunks", fail)
        if not ref.names or list(ref.names) != sorted(set(ref.names)):
            raise fail(f"{field}.names", "must list at least one array, sorted, each once")
        if len(ref.xxh3_64) != 16 * len(ref.names) or not _ARRAY_XXH3.fullmatch(ref.xxh3_64):
            raise fail(f"{field}.xxh3_64", "must hold 16 lowercase hex digits per array named")
        for name in ref.names:
            if not name or name == _RESERVED_KEY or name in names:
                raise fail(f"{field}.names", f"{name!r:.80} is empty, reserved or referenced twice")
            if name in replicas or (record.chunks and name not in chunks):
                raise fail(f"{field}.names", f"{name!r:.80} is another rank's, or not among the shard's chunks")
            names.add(name)


def _check_chunks(record: ShardRecord, where: str, fail: Callable[[str, str], ManifestError]) -> None:
    """Each chunk of a record names a distinct array, a known dtype and a box inside its tensor."""
    has_header = record.header_bytes > 0
    if (record.chunks or has_header) and not (
        _SHA256.fullmatch(record.header_sha256) and 8 <= record.header_bytes <= record.size_bytes
    ):
        raise fail(
            f"{where[: -len('.chunks')]}.header_sha256", "a shard with chunks needs its header's size and sha256"
        )
    if record.header_bytes > MAX_HEADER_BYTES + 8:  # read into memory of this size before it is verified
        raise fail(
            f"{where[: -len('.chunks')]}.header_bytes",
            f"is {record.header_bytes:,}, over the {MAX_HEADER_BYTES + 8:,} bytes a shard's header may take",
        )
    names: set[str] = set()
    for index, chunk in enumerate(record.chunks):
        field = f"{where}[{index}]"
        if not chunk.name or chunk.name == _RESERVED_KEY or chunk.name in names:
            raise fail(f"{field}.name", f"{chunk.name!r:.80} is empty, reserved or listed twice")
        names.add(chunk.name)
        if chunk.dtype not in DTYPES:
            raise fail(f"{field}.dtype", f"unknown dtype {chunk.dtype!r:.40}")
        if not _SHA256.fullmatch(chunk.sha256):
            raise fail(f"{field}.sha256", f"expected 64 lowercase hex digits, got {chunk.sha256[:80]!r}")
        if chunk.xxh3_64 and not _XXH3_64.fullmatch(chunk.xxh3_64):
            raise fail(f"{field}.xxh3_64", f"expected 16 lowercase hex digits, got {chunk.xxh3_64[:80]!r}")
        if not len(chunk.global_shape) == len(chunk.offsets) == len(chunk.sizes):
            raise fail(field, "global_shape, offsets and sizes must have as many dimensions")
        for dim, (whole, start, size) in enumerate(zip(chunk.global_shape, chunk.offsets, chunk.sizes, strict=True)):
            if start + size > whole:
                raise fail(f"{field}.sizes", f"dimension {dim}: {start} + {size} is beyond the tensor's {whole}")


def _check_replicas(manifest: ShardManifest, fail: Callable[[str, str], ManifestError]) -> None:
    """Each replica of a shard is named once, and is a chunk of its writer's shard (another rank's)."""
    stored = [{chunk.name for chunk in record.chunks} for record in manifest.shards]
    for record in manifest.shards:
        names: set[str] = set()
        for index, (name, writer) in enumerate(record.replicas):
            field = f"shards[rank {record.rank}].replicas[{index}]"
            if name in names or name in stored[record.rank]:
                raise fail(field, f"{name!r:.80} is listed twice, or also stored in this shard")
            names.add(name)
            if not 0 <= writer < manifest.world_size or writer == record.rank:
                raise fail(field, f"writer rank {writer} is not another rank of 0..{manifest.world_size - 1}")
            if name not in stored[writer]:
                raise fail(field, f"rank {writer}'s shard does not store {name!r:.80}")


def _check_same_tensors(manifest: ShardManifest, fail: Callable[[str, str], ManifestError]) -> None:
    """Every chunk of one tensor, on whichever rank, has the tensor's one dtype and global shape,
    unless each is a whole tensor: a plain array of a data-parallel save, which may differ
    between ranks (a rank's own value, kept in its own shard, never assembled from others)."""
    chunks: dict[str, list[tuple[int, ChunkRecord]]] = {}
    for record in manifest.shards:
        for chunk in record.chunks:
            chunks.setdefault(chunk.name, []).append((record.rank, chunk))
    for name, held in chunks.items():
        if all(chunk.sizes == chunk.global_shape and not any(chunk.offsets) for _rank, chunk in held):
            continue
        first = (held[0][1].dtype, held[0][1].global_shape)
        for rank, chunk in held:
            if first != (chunk.dtype, chunk.global_shape):
                raise fail(
                    f"shards[rank {rank}].chunks",
                    f"{name!r:.80} is {chunk.dtype} {chunk.global_shape} here, {first[0]} {first[1]} elsewhere",
                )
