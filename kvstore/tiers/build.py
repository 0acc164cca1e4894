"""The store's tiers, built by name from the registry (TIER_BACKENDS) and the config's sections.

The built-in layout is fixed by role: hot is a `device` tier (config hot.*), warm a `host` tier
(warm.*), cold an `lmdb` tier (cold.*, when cold.enabled). Extra tiers, (role, backend,
settings) with any backend registered under the entry point group `kvstore.tiers`, sit between
warm and cold in the order given. Slower tiers open first, so a refused cold store costs no
memory; on failure the tiers already open are closed.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvstore.config import Config
from kvstore.spec import KVSpec
from kvstore.tiers import device, disk, host  # noqa: F401 (they register the built-in backends)
from kvstore.tiers.base import TIER_BACKENDS, Tier

Layer = tuple[str, str, dict]   # (role, backend name, settings)


def layout(config: Config, spec: KVSpec, device_: torch.device, pool_bytes: int, shm_name: str | None,
           extra: Sequence[Layer] = ()) -> list[Layer]:
    """(role, backend, settings) of each tier, fastest first, from the config's hot, warm and cold sections."""
    layers = [("hot", "device", {"num_slots": pool_bytes // spec.page_bytes, "device": device_}),
              ("warm", "host", {"num_slots": config.warm.bytes // spec.page_bytes,
                                "shared": config.warm.shared_memory, "shm_name": shm_name}),
              *extra]
    if config.cold.enabled:
        layers.append(("cold", "lmdb", {"path": config.cold_path, "max_bytes": config.cold.max_bytes,
                                        "map_size_max": config.cold_map_size_max,
                                        "write_batch": config.cold.write_batch, "on_damage": config.cold.on_damage}))
    return layers


def build_tiers(spec: KVSpec, layers: Sequence[Layer]) -> list[Tier]:
    """One tier per layer, fastest first; each built by its backend's factory(role, spec, **settings)."""
    built: dict[int, Tier] = {}
    try:
        for i in reversed(range(len(layers))):
            role, backend, settings = layers[i]
            built[i] = TIER_BACKENDS.get(backend)(role, spec, **settings)
    except BaseException:
        for tier in built.values():
            tier.close()
        raise
    return [built[i] for i in range(len(layers))]
