"""What is stored: names on storage, manifests, the shard file, nested state <-> named arrays.

Nothing here opens a tier; the shard file reads and writes through ``tiered_ckpt.io``.
"""
