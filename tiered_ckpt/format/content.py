"""What an array holds, as one digest: how a save tells an unchanged array from a changed one.

An incremental save (:mod:`~tiered_ckpt.engine.incremental`) writes an array again only if
its content digest differs from the one the previous step recorded for the same name; an
equal digest makes it a reference to the earlier file that holds its bytes. The digest is
XXH3-128 over the array's dtype code, shape and bytes:

- 128 bits: two different arrays share a digest with probability 2**-128 per comparison, so
  a changed array taken as unchanged is impossible in practice, whatever the values (XXH3
  passes SMHasher's whole suite, whose sparse, cyclic and differential keys are the inputs
  on which weaker hashes collide). It is not a cryptographic hash: it does not resist
  inputs crafted to collide, which a training state is not;
- at about 15 GiB/s a core (sha256: 1.4), one pass over a state that changes whole costs a
  few percent of the write it precedes, while a cryptographic digest of every array would
  double the writer's hashing. What reaches a reader is still verified as before: each
  referenced array by its xxh3-64 and its file's header by sha256.

The digests of every array of a rank's state, its own and those it references, are kept in
its shard's header (``tiered_ckpt.xxh3_128``, verified with the header by its sha256), in
sorted name order: the next save compares with them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import numpy as np
import xxhash

from tiered_ckpt.errors import ShardFormatError
from tiered_ckpt.format.shardfile import DTYPE_CODES

__all__ = ["DIGESTS_KEY", "DIGEST_HEADER_BYTES", "content_digest", "digests_text", "parse_digests"]

DIGESTS_KEY = "tiered_ckpt.xxh3_128"
DIGEST_HEADER_BYTES = 32
"""The bytes one array's digest adds to its shard's header."""

_HEX = re.compile(r"(?:[0-9a-f]{32})*")


def content_digest(array: np.ndarray) -> str:
    """The XXH3-128 of ``array``'s dtype code, shape and bytes (32 hex digits); "" for an
    array whose memory is not one C-contiguous block of little-endian (or byte-sized) values,
    as the shard stores them: such an array is never taken as unchanged."""
    if not array.flags.c_contiguous or array.dtype.byteorder == ">":
        return ""
    code = DTYPE_CODES.get(array.dtype)
    if code is None:
        return ""
    digest = xxhash.xxh3_128(f"{code}{list(array.shape)}".encode())
    if array.size:
        digest.update(array.reshape(-1).view(np.uint8).data)
    return digest.hexdigest()


def digests_text(digests: Mapping[str, str]) -> str:
    """The header's value for ``digests`` (every array of a state, each with its digest)."""
    return "".join(digests[name] or "0" * 32 for name in sorted(digests))


def parse_digests(metadata: Mapping[str, str], names: Iterable[str], what: str) -> dict[str, str]:
    """By name, the content digest a verified header's ``metadata`` records for each of ``names``
    (every array of the shard's state); {} if it records none. :class:`ShardFormatError` naming
    ``what`` if the value is not one digest per array."""
    text = metadata.get(DIGESTS_KEY)
    if text is None:
        return {}
    ordered = sorted(names)
    if len(text) != 32 * len(ordered) or not _HEX.fullmatch(text):
        raise ShardFormatError(f"{what}: {DIGESTS_KEY} does not hold one digest per array of {len(ordered)}")
    digests = {name: text[32 * i : 32 * i + 32] for i, name in enumerate(ordered)}
    return {name: digest for name, digest in digests.items() if digest != "0" * 32}
