"""The tier contract (tests/tier_contract.py) on each tier: memory here; each real tier's tests subclass it too."""

import pytest
from memory_tier import MemoryTier
from tier_contract import TierContract


class TestMemoryTier(TierContract):
    @pytest.fixture
    def tier(self):
        return MemoryTier()

    def replace_shard(self, tier, step, record, data):
        tier.shards[(step, record.path)] = data

    def replace_manifest(self, tier, step, data):
        tier.manifests[step] = data


class TestLocalTier(TierContract):
    @pytest.fixture
    def tier(self, tmp_path):
        from tiered_ckpt.tiers.local import LocalTier

        tier = LocalTier(tmp_path / "local")
        with tier.lock():
            yield tier

    def replace_shard(self, tier, step, record, data):
        tier.shard_path(step, record).write_bytes(data)

    def replace_manifest(self, tier, step, data):
        from tiered_ckpt.format.layout import MANIFEST_NAME

        (tier.step_dir(step) / MANIFEST_NAME).write_bytes(data)
