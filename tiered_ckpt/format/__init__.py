"""What is stored: names on storage, manifests, the shard file, nested state <-> named arrays.

``layout`` (names), ``manifest`` (with ``strict_json``, its untrusted-JSON reader),
``shardfile`` (the safetensors file), ``structure`` (the structure document) and
``state`` (a nested state flattened to named arrays). Nothing here opens a tier or
imports from ``tiers``, ``engine`` or ``dist``; the shard file reads and writes through
``tiered_ckpt.io``, and torch objects are read through ``tiered_ckpt.torch`` without
importing torch.
"""

__all__: list[str] = []
