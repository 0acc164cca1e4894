"""The store as the engine sees it: `TieredStore` (`tiered`), a request's hold on its cached
prefix (`handle`), warm pages shared in place (`sharing`).
"""
