"""Bytes on a file system: durable writes (temp, fsync, rename), block reads, and hashing.

Below ``format``: nothing here knows a shard, a manifest or a tier.
"""

__all__: list[str] = []
