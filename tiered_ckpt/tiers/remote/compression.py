"""Shards compressed on their way to the bucket and decompressed on the way back (``remote.compression``).

``"none"`` (the default) puts each shard file as it is; ``"zstd"`` puts it as independent
zstd frames (:mod:`~tiered_ckpt.io.zstd_frames`) under the shard's name with ``.zst``, the
remote manifest recording how (:class:`~tiered_ckpt.format.compressed.CompressedObject`).
What a reader does never depends on the option: each step's remote manifest says how each
of its objects is stored, so one bucket holds compressed and uncompressed steps alike.

Compressing a shard (:func:`compressed_copy`) reads it once, in frames of
:data:`FRAME_BYTES` (its header alone in the first), checking it against its record's size
and xxh3-64 on the way (a shard damaged on local disk is never uploaded), into a temp file
beside it (the local tier's disk: it has room for shards, and the next start removes what
a crash leaves there), which is uploaded and removed. The shard's record keeps the
uncompressed sha256, against which every download is verified.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from tiered_ckpt.errors import invalid_option
from tiered_ckpt.format.compressed import SUFFIX, CompressedObject
from tiered_ckpt.format.manifest import ShardRecord
from tiered_ckpt.io.durable import temp_name
from tiered_ckpt.io.zstd_frames import available, compress_frames, frame_lengths

__all__ = ["COMPRESSIONS", "Compression", "FRAME_BYTES", "check_compression", "compressed_copy", "object_name"]

Compression = Literal["none", "zstd"]
COMPRESSIONS: tuple[Compression, ...] = ("none", "zstd")
# A ranged read fetches and decompresses whole frames: 4 MiB keeps a small array's read near
# 3 MiB over the wire and 5 ms of decoding, and a 1 GiB shard's index near 256 numbers.
FRAME_BYTES = 4 << 20


def check_compression(value: object) -> None:
    """Raise :class:`~tiered_ckpt.ConfigError` (field ``compression``) unless ``value`` is one of
    :data:`COMPRESSIONS` that this process can write (``"zstd"`` needs the ``zstandard`` package)."""
    if value not in COMPRESSIONS:
        raise invalid_option("compression", f"must be one of {sorted(COMPRESSIONS)}, got {value!r:.60}")
    if value == "zstd" and not available():
        raise invalid_option("compression", "'zstd' needs the zstandard package: pip install 'tiered-ckpt[zstd]'")


def object_name(name: str, compressed: CompressedObject | None) -> str:
    """The name of the object holding a shard stored as ``compressed`` says (None: as it is) under ``name``."""
    return name + SUFFIX if compressed is not None else name


@contextmanager
def compressed_copy(path: Path, record: ShardRecord, what: str) -> Iterator[tuple[Path, CompressedObject]]:
    """The shard file ``path`` compressed into independent zstd frames, as a temp file beside it
    (removed on leaving), and the entry saying how; :class:`ChecksumMismatchError` naming ``what``
    unless the file has ``record``'s size and xxh3-64. Memory: two frames' worth of buffers."""
    head = record.header_bytes if 0 < record.header_bytes < record.size_bytes else FRAME_BYTES
    target = path.with_name(temp_name(record.path + SUFFIX))
    try:
        with open(path, "rb", buffering=0) as source, open(target, "wb") as out:
            made = compress_frames(source, out, frame_lengths(record.size_bytes, head, FRAME_BYTES))
        record.verify(made.source, f"{what} (before its compression)")
        yield target, CompressedObject.made(made, head, FRAME_BYTES)
    finally:
        target.unlink(missing_ok=True)
