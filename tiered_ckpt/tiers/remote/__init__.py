"""The object-store tier: a bucket (or any fsspec URL) every node reads.

One feature, one folder: the tier (:mod:`.tier`), its step prefixes and their listing
(:mod:`.listing`), run leases (:mod:`.leases`) and the owner records and open uploads they
keep (:mod:`.upkeep`), its requests (:mod:`.requests`) under the retry policy (:mod:`.retry`),
the store's checksums (:mod:`.checksums`), compression (:mod:`.compression`), and one backend
per store (:mod:`.backends`).
"""

from tiered_ckpt.tiers.remote.tier import RemoteTier

__all__ = ["RemoteTier"]
