"""The kvstore KV connector for vLLM: see kvstore_vllm.connector."""
