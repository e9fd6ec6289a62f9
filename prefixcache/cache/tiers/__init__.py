"""Lower KV tiers below the device store: host memory, local disk, Redis (see ``chain``)."""
from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from prefixcache.cache.tiers.chain import KVShape, TierChain
from prefixcache.cache.tiers.codec import BlockKeys
from prefixcache.config import CacheConfig

__all__ = ["KVShape", "TierChain", "build_chain"]
log = logging.getLogger(__name__)
SECRET_FILE = "secret"


def build_chain(config: CacheConfig, shape: KVShape, clock: Callable[[], float] = time.time) -> TierChain | None:
    """The tiers ``config`` asks for, in order host, disk, Redis; None when it asks for none.

    The host tier is left out when the KV lives on the CPU already. Without
    ``hash_secret`` a disk tier keeps a random secret in its directory (so it survives a
    restart); with no disk tier the secret is drawn per process.
    """
    tiers = []
    if config.tier_host_bytes > 0:
        if shape.device.type == "cpu":
            log.info("host tier off: the model's KV is in host memory already")
        else:
            from prefixcache.cache.tiers.host import HostTier

            tiers.append(HostTier(config.tier_host_bytes, shape.device, clock))
    if config.tier_disk is not None:
        from prefixcache.cache.tiers.disk import DiskTier

        tiers.append(DiskTier(config.tier_disk, config.tier_disk_bytes, clock))
    if config.tier_redis is not None:
        from prefixcache.cache.tiers.redis_tier import RedisTier

        tiers.append(RedisTier(config.tier_redis, config.tier_redis_bytes, clock))
    if not tiers:
        return None
    if config.hash_secret is not None:
        secret = config.hash_secret.encode()
    elif config.tier_disk is not None:
        secret = disk_secret(Path(config.tier_disk))
    else:
        secret = secrets.token_bytes(32)
    return TierChain(tiers, BlockKeys(secret, shape.name), shape, write_policy=config.tier_write_policy,
                     queue_bytes=config.tier_queue_bytes, clock=clock)


def disk_secret(directory: Path) -> bytes:
    """The disk tier's own random secret, created (readable by its owner only) on first use."""
    path = directory / SECRET_FILE
    directory.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return bytes.fromhex(path.read_text().strip())
    value = secrets.token_bytes(32)
    with os.fdopen(fd, "w") as f:
        f.write(value.hex())
    return value
