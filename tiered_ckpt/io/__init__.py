"""Bytes on a file system: durable writes (temp, fsync, rename) and block reads."""
