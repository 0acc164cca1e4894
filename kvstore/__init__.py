"""kvstore: a tiered KV-cache store (hot GPU pool, warm pinned host memory, cold LMDB) for LLM inference."""

__version__ = "0.1.0"
