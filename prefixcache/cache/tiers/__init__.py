"""Lower KV tiers below the device store: host memory, local disk, Redis (see ``chain``)."""
from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable

from prefixcache.cache.tiers.chain import KVShape, TierChain, TierPurgeError
from prefixcache.cache.tiers.codec import MIN_SECRET_BYTES, BlockKeys
from prefixcache.config import CacheConfig

__all__ = ["KVShape", "TierChain", "TierPurgeError", "build_chain"]
log = logging.getLogger(__name__)


def build_chain(config: CacheConfig, shape: KVShape, clock: Callable[[], float] = time.time,
                idle: Callable[[], None] = lambda: None) -> TierChain | None:
    """The tiers ``config`` asks for, in order host, disk, Redis; None when it asks for none.

    The host tier is left out when the KV lives on the CPU already. Without
    ``hash_secret`` a disk tier keeps a random secret in its directory (so it survives a
    restart); with no disk tier the secret is drawn per process. A tier that cannot start
    releases those started before it (the disk tier's directory lock) and raises. ``idle``: called by
    the chain's writer thread before it waits for blocks.
    """
    tiers: list = []
    try:
        disk = None
        if config.tier_host_bytes > 0:
            if shape.device.type == "cpu":
                log.info("host tier off: the model's KV is in host memory already")
            else:
                from prefixcache.cache.tiers.host import HostTier

                tiers.append(HostTier(config.tier_host_bytes, shape.device, clock))
        if config.tier_disk is not None:
            from prefixcache.cache.tiers.disk import DiskTier

            disk = DiskTier(config.tier_disk, config.tier_disk_bytes, clock)
            tiers.append(disk)
        if config.tier_redis is not None:
            from prefixcache.cache.tiers.redis_tier import RedisTier

            tiers.append(RedisTier(config.tier_redis, config.tier_redis_bytes, clock,
                                   prefix=config.tier_redis_prefix))
        if not tiers:
            return None
        if config.hash_secret is not None:
            secret = config.hash_secret.encode()
        elif disk is not None:
            secret = disk.own_secret()
        else:
            secret = secrets.token_bytes(MIN_SECRET_BYTES)
        return TierChain(tiers, BlockKeys(secret, shape.name), shape, write_policy=config.tier_write_policy,
                         queue_bytes=config.tier_queue_bytes, clock=clock, encrypt=config.tier_encrypt, idle=idle)
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
