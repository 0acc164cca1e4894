"""The store as the engine sees it: `TieredStore` (`tiered`), built of parts that share a narrow
core (`core`: the lock, the index, the mover, the tiers): the engine's verbs on hot pages (`hot`),
a request's hold on its cached prefix (`handle`), warm pages shared in place (`sharing`), remote
pages fetched into warm (`fetch`), and the snapshot the admin views read (`snapshot`).
"""
