"""The peer tier: a partner node's memory holding each rank's newest shards.

One feature, one folder: the tier (:mod:`.tier`), its copies in this process's memory
(:mod:`.memory`) and their transfer (:mod:`.copies`), how partners are chosen from the
ranks' nodes (:mod:`.partners`), the point-to-point link the copies travel on (:mod:`.link`)
and the collective set-up of a running job (:mod:`.setup`).
"""

from tiered_ckpt.tiers.peer.tier import PeerTier

__all__ = ["PeerTier"]
