"""kvstore as SGLang HiCache's L3 storage backend: kvstore_sglang.storage.KVStoreStorage."""
