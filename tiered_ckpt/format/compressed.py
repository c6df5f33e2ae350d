"""How one shard's object is stored compressed: the entry a remote manifest keeps for it.

A compressed shard object is the shard file as independent zstd frames
(:mod:`~tiered_ckpt.io.zstd_frames`): the first frame holds the file's first ``head_bytes``
(its header, where the manifest records it: a reader of the header fetches that frame
alone), each later one ``frame_bytes`` of it, the last the rest. The entry records the
object's own size and xxh3-64 (of the compressed bytes: what the store holds and its
checksums are of) and each frame's compressed size: with those, the object's bytes
``offsets[i]:offsets[i + 1]`` decompress to the shard's bytes ``starts[i]:starts[i + 1]``.
The shard record keeps the sha256, xxh3-64 and size of the *uncompressed* shard, and the
sha256 stored beside the object (its metadata, on S3 and GCS) is that one: of the shard it
holds, which every download is verified against.

An entry read from a bucket is untrusted: :meth:`CompressedObject.from_dict` refuses any
field this library would not have written, and :meth:`CompressedObject.problem` one that
does not fit its shard's size (each frame at most its raw size, so no read fetches or
allocates more than the shard's bytes and some framing).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Literal

from tiered_ckpt.errors import ManifestError
from tiered_ckpt.format.manifest import ShardRecord
from tiered_ckpt.format.shardfile import MAX_HEADER_BYTES
from tiered_ckpt.format.strict_json import Fields
from tiered_ckpt.io.zstd_frames import Compressed, FrameIndex, frame_lengths, raw_frame_bytes

__all__ = ["CODECS", "Codec", "CompressedObject", "MAX_FRAME_BYTES", "MIN_FRAME_BYTES", "SUFFIX"]

Codec = Literal["zstd"]
CODECS: tuple[Codec, ...] = ("zstd",)
SUFFIX = ".zst"  # a compressed object's name: the shard's name and this (``zstd -d`` restores the shard)
MIN_FRAME_BYTES = 64 << 10
MAX_FRAME_BYTES = 256 << 20  # what one frame read may allocate, whatever a manifest says
_XXH3_64 = re.compile(r"[0-9a-f]{16}")
_FIELDS = {"codec", "size_bytes", "xxh3_64", "head_bytes", "frame_bytes", "frames"}


@dataclass(frozen=True)
class CompressedObject:
    """One shard object stored compressed (see the module doc): its ``codec``, its own
    ``size_bytes`` and ``xxh3_64``, the uncompressed ``head_bytes`` of its first frame and
    ``frame_bytes`` of each later one, and each frame's compressed size (``frames``)."""

    codec: Codec
    size_bytes: int
    xxh3_64: str
    head_bytes: int
    frame_bytes: int
    frames: tuple[int, ...]

    @classmethod
    def made(cls, compressed: Compressed, head_bytes: int, frame_bytes: int) -> CompressedObject:
        """The entry of an object :func:`~tiered_ckpt.io.zstd_frames.compress_frames` just wrote."""
        out = compressed.output
        return cls("zstd", out.size_bytes, out.xxh3_64, head_bytes, frame_bytes, compressed.frames)

    def lengths(self, shard_bytes: int) -> list[int]:
        """Each frame's uncompressed length, for a shard of ``shard_bytes``."""
        return frame_lengths(shard_bytes, self.head_bytes, self.frame_bytes)

    def index(self, shard_bytes: int) -> FrameIndex:
        """The frame index of this object, for a shard of ``shard_bytes`` (an entry a remote manifest
        holds was checked against its shard on reading: see :meth:`problem`)."""
        return _index(self, shard_bytes)

    def object_record(self, record: ShardRecord) -> ShardRecord:
        """``record`` as its object is put and confirmed: the object's own size and xxh3-64 (what an
        upload checks the file by), the shard's sha256 (what the store's metadata keeps beside it),
        no digests of the parts of the shard."""
        return replace(
            record,
            size_bytes=self.size_bytes,
            xxh3_64=self.xxh3_64,
            chunks=(),
            header_bytes=0,
            header_sha256="",
            replicas=(),
            array_xxh3_64="",
        )

    def problem(self, shard_bytes: int) -> str | None:
        """Why this entry cannot be the object of a shard of ``shard_bytes``, as a phrase; None if it can."""
        if self.codec not in CODECS:
            return f"unknown codec {self.codec!r:.40}"
        if not _XXH3_64.fullmatch(self.xxh3_64):
            return "xxh3_64 must be 16 lowercase hex digits"
        if not MIN_FRAME_BYTES <= self.frame_bytes <= MAX_FRAME_BYTES:
            return f"frame_bytes {self.frame_bytes} is outside {MIN_FRAME_BYTES}..{MAX_FRAME_BYTES}"
        if not (shard_bytes == 0 or 1 <= self.head_bytes <= max(self.frame_bytes, MAX_HEADER_BYTES + 8)):
            return f"head_bytes {self.head_bytes} is not a first frame this library writes"
        lengths = self.lengths(shard_bytes)
        if len(self.frames) != len(lengths):
            return f"{len(self.frames)} frames, a shard of {shard_bytes} bytes has {len(lengths)}"
        for number, (size, length) in enumerate(zip(self.frames, lengths, strict=True)):
            if not 1 <= size <= raw_frame_bytes(length):
                return f"frame {number} takes {size} bytes, more than the {raw_frame_bytes(length)} of its raw form"
        if sum(self.frames) != self.size_bytes:
            return f"the frames take {sum(self.frames)} bytes, size_bytes is {self.size_bytes}"
        return None

    def to_dict(self) -> dict[str, Any]:
        """The entry as the remote manifest's JSON holds it."""
        return {
            "codec": self.codec,
            "size_bytes": self.size_bytes,
            "xxh3_64": self.xxh3_64,
            "head_bytes": self.head_bytes,
            "frame_bytes": self.frame_bytes,
            "frames": list(self.frames),
        }

    def to_json(self) -> str:
        """The entry as compact JSON (how the processes of a job hand it to the one that commits)."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, document: Mapping[str, Any], *, source: str, prefix: str = "") -> CompressedObject:
        """Read a parsed entry strictly (types and known fields only: see :meth:`problem` for the
        rest); errors name ``source`` and the field under ``prefix``."""
        if not isinstance(document, Mapping):
            raise ManifestError(f"{source}: field '{prefix.rstrip('.')}': expected an object")
        fields = Fields(document, source, prefix)
        fields.reject_unknown(_FIELDS)
        codec = fields.string("codec")
        if codec not in CODECS:
            raise ManifestError(
                f"{source}: field '{prefix}codec': unknown codec {codec[:40]!r} (this library reads zstd)"
            )
        return cls(
            codec="zstd",
            size_bytes=fields.integer("size_bytes", minimum=0),
            xxh3_64=fields.string("xxh3_64"),
            head_bytes=fields.integer("head_bytes", minimum=0),
            frame_bytes=fields.integer("frame_bytes", minimum=1),
            frames=_frames(fields.list_of("frames", int), source, f"{prefix}frames"),
        )

    @classmethod
    def from_json(cls, text: str, *, source: str) -> CompressedObject:
        """Read what :meth:`to_json` wrote (strictly, as :meth:`from_dict`)."""
        try:
            document = json.loads(text)
        except ValueError as exc:
            raise ManifestError(f"{source}: not a compressed object's entry: {exc}") from None
        return cls.from_dict(document, source=source)


def _frames(sizes: list[Any], source: str, field: str) -> tuple[int, ...]:
    for number, size in enumerate(sizes):
        if isinstance(size, bool) or size < 1:
            raise ManifestError(f"{source}: field '{field}[{number}]': expected an integer >= 1, got {size!r:.40}")
    return tuple(sizes)


@lru_cache(maxsize=256)
def _index(entry: CompressedObject, shard_bytes: int) -> FrameIndex:
    return FrameIndex(tuple(entry.lengths(shard_bytes)), entry.frames)
