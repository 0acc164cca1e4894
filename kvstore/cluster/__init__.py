"""Cross-instance sharing: the prefix index in Redis (redis_index.py) and fetching pages from peers (peer.py)."""
