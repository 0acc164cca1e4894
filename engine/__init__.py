"""The decoding engine: Llama-family models over kvstore's tiered KV cache.

The names below load on first use, so that `engine.config` (which the `kvstore` command reads
for every subcommand) does not pull in the model code.
"""

import importlib

_EXPORTS = {"LLM": "engine.llm", "AsyncLLM": "engine.async_llm", "QueueFull": "engine.request",
            "RequestOutput": "engine.request", "InvalidRequest": "engine.sampler", "SamplingParams": "engine.sampler"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
