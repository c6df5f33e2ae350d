"""The backend contract: what every store under the object-store tier guarantees, written once.

A backend's tests (``tiered_ckpt/tiers/remote/backends/``, or one written out of this repository)
subclass :class:`BackendContract` and provide a ``backend`` fixture: a backend on a fresh, empty
URL (its bucket created)::

    from tiered_ckpt.testing.backend import BackendContract

    class TestMyBackend(BackendContract):
        @pytest.fixture
        def backend(self, my_bucket_url):
            return MyBackend(...)

pytest collects the contract's tests on the subclass. They hold a backend to what
:class:`~tiered_ckpt.tiers.remote.backends.base.Backend` promises the tier: small objects
written whole (create-only where its capabilities say so), read whole and in ranges, sizes and heads
asked of the store; listings, finds and deletes that name exact keys (no glob expansion, a
step's neighbour with a longer name untouched); a shard put with its record's sha256 beside it
where the store keeps metadata, a file unlike its record never made an object, and the store's
own checksums of it equal to those the backend computes where it keeps any.

This module imports pytest: the package itself never imports it, only a test suite does.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from tiered_ckpt.errors import ChecksumMismatchError
from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.testing.tier import record_of, shard_bytes
from tiered_ckpt.tiers.base import Capabilities
from tiered_ckpt.tiers.remote.backends.base import Backend, Head

__all__ = ["BackendContract"]


class BackendContract:
    """Subclass with a ``backend`` fixture (see the module)."""

    def at(self, backend: Any, *names: str) -> str:
        """The path of ``names`` under the backend's root, as the tier builds it."""
        return "/".join([backend.root, *names])

    def shard_file(self, tmp_path: Path, size: int = 200_000) -> tuple[Path, Any]:
        """A local shard file of ``size`` bytes and its record."""
        data = shard_bytes(4, 0, size)
        path = tmp_path / "shard.bin"
        path.write_bytes(data)
        return path, record_of(0, data)

    # -- the protocol ------------------------------------------------------------------

    def test_it_speaks_the_protocol(self, backend):
        assert isinstance(backend, Backend) and isinstance(backend.capabilities, Capabilities)
        assert isinstance(backend.url, str) and backend.url
        assert isinstance(backend.root, str) and not backend.root.endswith("/")
        assert backend.list_names(backend.root) == [] and backend.find(backend.root) == []

    # -- small objects -------------------------------------------------------------------

    def test_a_small_object_reads_back_whole_and_in_ranges(self, backend):
        path = self.at(backend, step_dir_name(1), "manifest.json")
        data = bytes(range(256)) * 4
        backend.put_bytes(path, data)
        assert backend.exists(path) and backend.size(path) == len(data) and backend.head(path).size == len(data)
        assert backend.read(path) == data
        if backend.capabilities.ranged_reads:
            assert backend.read(path, 100, 300) == data[100:300]
        with backend.open(path) as stream:
            assert stream.read() == data

    def test_an_overwrite_replaces_the_object(self, backend):
        path = self.at(backend, "latest")
        backend.put_bytes(path, b"1")
        backend.put_bytes(path, b"22")
        assert backend.read(path) == b"22" and backend.size(path) == 2

    def test_a_create_only_write_never_replaces_an_object_where_the_store_says_it_can(self, backend):
        if not backend.capabilities.create_only_commit:
            pytest.skip("this store cannot write create-only")
        path = self.at(backend, step_dir_name(2), "manifest.json")
        backend.put_bytes(path, b"first", create_only=True)
        with pytest.raises(FileExistsError):
            backend.put_bytes(path, b"second", create_only=True)
        assert backend.read(path) == b"first"

    def test_a_missing_object_is_missing(self, backend):
        path = self.at(backend, step_dir_name(3), "manifest.json")
        assert not backend.exists(path)
        with pytest.raises(FileNotFoundError):
            backend.head(path)

    # -- listing and deleting exact keys -------------------------------------------------

    def test_listings_name_exact_keys_and_a_longer_neighbour_stays_out(self, backend):
        for step in (1, 10):
            for name in ("rank-0.bin", "manifest.json"):
                backend.put_bytes(self.at(backend, f"step-{step}", name), b"x")
        backend.put_bytes(self.at(backend, "sweep[12]", "a"), b"x")
        backend.put_bytes(self.at(backend, "sweep1", "a"), b"x")
        assert sorted(backend.list_names(backend.root)) == ["step-1", "step-10", "sweep1", "sweep[12]"]
        assert backend.find(self.at(backend, "step-1")) == [
            self.at(backend, "step-1", "manifest.json"),
            self.at(backend, "step-1", "rank-0.bin"),
        ]
        assert backend.find(self.at(backend, "sweep[12]")) == [self.at(backend, "sweep[12]", "a")]
        assert backend.find(self.at(backend, "absent")) == [] and backend.list_names(self.at(backend, "absent")) == []

    def test_deletes_remove_exactly_what_they_name(self, backend):
        for step in (1, 10):
            for name in ("rank-0.bin", "manifest.json"):
                backend.put_bytes(self.at(backend, f"step-{step}", name), b"x")
        backend.delete([self.at(backend, "step-10", "manifest.json")])
        backend.delete([self.at(backend, "step-10", "manifest.json")])  # one already gone is no error
        assert backend.find(self.at(backend, "step-10")) == [self.at(backend, "step-10", "rank-0.bin")]
        backend.delete_prefix(self.at(backend, "step-1"))
        assert backend.find(self.at(backend, "step-1")) == []
        assert backend.find(self.at(backend, "step-10")) == [self.at(backend, "step-10", "rank-0.bin")]

    # -- shards --------------------------------------------------------------------------

    def test_a_shard_put_reads_back_with_its_sha256_where_the_store_keeps_metadata(self, backend, tmp_path):
        local, record = self.shard_file(tmp_path)
        path = self.at(backend, step_dir_name(4), record.path)
        sent = backend.put_shard(local, path, record, deadline=None)
        assert sent.requests >= 1 and backend.read(path) == local.read_bytes()
        head = backend.head(path)
        assert isinstance(head, Head) and head.size == record.size_bytes
        assert head.sha256 == (record.sha256 if backend.keeps_metadata else None)
        assert hashlib.sha256(backend.read(path)).hexdigest() == record.sha256
        assert backend.open_uploads() == []

    def test_a_file_unlike_its_record_is_never_made_an_object(self, backend, tmp_path):
        local, record = self.shard_file(tmp_path)
        other = bytearray(local.read_bytes())
        other[len(other) // 2] ^= 0x01
        local.write_bytes(bytes(other))  # the record's size, other bytes
        path = self.at(backend, step_dir_name(4), record.path)
        with pytest.raises(ChecksumMismatchError):
            backend.put_shard(local, path, record, deadline=None)
        assert not backend.exists(path)

    def test_the_checksums_a_backend_computes_are_the_ones_its_store_keeps(self, backend, tmp_path):
        local, record = self.shard_file(tmp_path)
        expected = backend.sums(local, record)
        if not backend.capabilities.store_checksums:
            assert expected is None
            return
        path = self.at(backend, step_dir_name(4), record.path)
        backend.put_shard(local, path, record, deadline=None)
        assert expected is not None
        assert backend.store_problem(backend.head(path), expected) is None
