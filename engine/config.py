"""The engine's sections of the config tree (engine, scheduler), and the tree they extend.

`Config` is the store's tree (kvstore.config.Config) plus these sections: one file, one
precedence (defaults < file < KVSTORE_* environment < flags), one `kvstore config --keys`.
The store alone loads its own tree; the `kvstore` programs load app.api.config's, which adds the
API's server section.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from kvstore import config as store_config
from kvstore.config import _bool, _int, _str, mapping, opt

ENGINE_DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULER_POLICIES = ("fcfs", "priority", "preemptive")


@dataclass(frozen=True)
class EngineConfig:
    dtype: str = opt("auto", _str, f"one of {', '.join(ENGINE_DTYPES)} (auto: bfloat16 on GPU, float32 on CPU)",
                     lambda v: v in ENGINE_DTYPES)
    attention_backend: str = opt("auto", _str, "auto, flashinfer, native, sdpa or torch",
                                 lambda v: v in ("auto", "flashinfer", "native", "sdpa", "torch"))
    prepack_weights: str = opt("auto", _str, "auto, true or false (true needs the CPU and float32 or bfloat16)",
                               lambda v: v in ("auto", "true", "false"))
    max_batch_tokens: int = opt(8192, _int, "an integer >= 1", lambda v: v >= 1)
    prefill_chunk_tokens: int = opt(512, _int, "an integer >= 1", lambda v: v >= 1)
    prefill_concurrency: int = opt(4, _int, "an integer >= 1", lambda v: v >= 1)
    prefill_alone_tokens: int = opt(2048, _int, "an integer >= 0 (0: off; on the CPU, a step computes at most one "
                                    "prefill of a prompt this long)", lambda v: v >= 0)
    decode_concurrency: int = opt(64, _int, "an integer >= 1", lambda v: v >= 1)
    share_across_tenants: bool = opt(False, _bool, "true or false")
    seed: int = opt(0, _int, "an integer (seeds the random weights of presets)")
    check_invariants: bool = opt(False, _bool, "true or false (debug: check the scheduler's and store's "
                                 "invariants after every step; slow)")


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = opt("fcfs", _str, f"one of {', '.join(SCHEDULER_POLICIES)}", lambda v: v in SCHEDULER_POLICIES)
    max_queue_depth: int = opt(512, _int, "an integer >= 1", lambda v: v >= 1)
    tenant_quota_pages: int = opt(0, _int, "an integer >= 0 (0: no quota)", lambda v: v >= 0)
    tenant_quotas: dict = opt({}, mapping(_int), "a mapping tenant -> hot pages (or 'a=100,b=50')",
                              lambda v: all(n >= 0 for n in v.values()))


@dataclass(frozen=True)
class Config(store_config.Config):
    """The store's config tree with the engine's sections."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


load_config = partial(store_config.load_config, root=Config)
load_config.__doc__ = "kvstore.config.load_config for the engine's tree (file, env, overrides) -> Config."


def key_paths() -> dict:
    """Every leaf key of the engine's tree, by dotted path."""
    return store_config.key_paths(Config)
