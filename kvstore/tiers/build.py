"""The store's tiers, built by name from the registry (TIER_BACKENDS) and the config's sections.

The layout is fixed by role: hot (config hot.*), warm (warm.*), cold (cold.*, when
cold.enabled); each role's backend is its section's `backend` key (built in: `device`, `host`,
`lmdb`), any backend registered under the entry point group `kvstore.tiers`, which gets the
section's settings. Extra tiers, (role, backend,
settings) with any backend registered under the entry point group `kvstore.tiers`, sit between
warm and cold in the order given. Slower tiers open first, so a refused cold store costs no
memory; on failure the tiers already open are closed.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvstore.config import Config
from kvstore.errors import ConfigError
from kvstore.pages.spec import KVSpec
from kvstore.tiers import device, disk, host  # noqa: F401 (they register the built-in backends)
from kvstore.tiers.base import TIER_BACKENDS, Tier

Layer = tuple[str, str, dict]   # (role, backend name, settings)


def layout(config: Config, spec: KVSpec, device_: torch.device, pool_bytes: int, shm_name: str | None,
           extra: Sequence[Layer] = (), head_room: int = 0) -> list[Layer]:
    """(role, backend, settings) of each tier, fastest first, from the config's hot, warm and cold
    sections. head_room: bytes warm leaves before each page for a remote read to land a whole record
    in (kvstore.remote.head_room; none in shared memory, which another process maps slot by slot)."""
    warm = {"num_slots": config.warm.bytes // spec.page_bytes, "shared": config.warm.shared_memory,
            "shm_name": shm_name}
    if head_room and not config.warm.shared_memory:
        warm.update(num_slots=config.warm.bytes // host.slot_stride(spec, head_room), head_room=head_room)   # warm.bytes bounds the memory
    layers = [("hot", config.hot.backend, {"num_slots": pool_bytes // spec.page_bytes, "device": device_}),
              ("warm", config.warm.backend, warm), *extra]
    if config.cold.enabled:
        layers.append(("cold", config.cold.backend, {"path": config.cold_path, "max_bytes": config.cold.max_bytes,
                                        "map_size_max": config.cold_map_size_max,
                                        "write_batch": config.cold.write_batch, "on_damage": config.cold.on_damage}))
    return layers


def backend_of(role: str, name: str):
    """The factory registered as `name`; ConfigError naming `<role>.backend` when there is none."""
    try:
        return TIER_BACKENDS.get(name)
    except ConfigError:
        raise ConfigError(f"{role}.backend", name, "must be a tier backend registered under the entry point "
                                                   f"group kvstore.tiers: {', '.join(TIER_BACKENDS.names())}") from None


def build_tiers(spec: KVSpec, layers: Sequence[Layer]) -> list[Tier]:
    """One tier per layer, fastest first; each built by its backend's factory(role, spec, **settings)."""
    built: dict[int, Tier] = {}
    try:
        for i in reversed(range(len(layers))):
            role, backend, settings = layers[i]
            built[i] = backend_of(role, backend)(role, spec, **settings)
    except BaseException:
        for tier in built.values():
            tier.close()
        raise
    return [built[i] for i in range(len(layers))]
