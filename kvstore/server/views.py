"""Views of the store's index for the admin API, built in a worker thread under the store's lock."""

from __future__ import annotations

import heapq

from kvstore.movement.mover import TIERS
from kvstore.placement.index import PageEntry


def _page_json(e: PageEntry, now: float, page_size: int) -> dict:
    pinned = e.pinned(now)
    return {"key": e.key.hex(), "parent": e.parent.hex(), "namespace": e.namespace.hex(), "depth": e.depth,
            "tokens": page_size, "tier": e.tier,
            "tiers": [t for t, here in zip(TIERS, (e.hot is not None, e.warm is not None, e.cold)) if here],
            "refcount": e.refcount, "pinned": pinned,
            "pin_remaining_s": round(e.pin_until - now, 3) if pinned else None,
            "hits": e.hits, "last_access": e.last_access, "children": len(e.kids)}


def list_pages(store, tier: str | None, namespace: bytes | None, pinned: bool | None, limit: int,
               cursor: bytes | None) -> dict:
    """Pages matching the filters, in key order, `limit` after `cursor`: O(entries log limit)."""
    with store._lock:
        now = store.index.now()
        entries = store.index.in_tier(tier) if tier else store.index.entries.values()
        matching = [e for e in entries if (namespace is None or e.namespace == namespace)
                    and (pinned is None or e.pinned(now) == pinned)]
        after = matching if cursor is None else [e for e in matching if e.key > cursor]
        chosen = heapq.nsmallest(limit + 1, after, key=lambda e: e.key)
        pages = [_page_json(e, now, store.spec.page_size) for e in chosen[:limit]]
    return {"pages": pages, "next_cursor": pages[-1]["key"] if len(chosen) > limit else None,
            "total": len(matching)}


def write_health(store) -> dict:
    """/readyz's view of write-behind (the dirty pages against their bound, the oldest one's age,
    pages cold refused) and of the pages dropped, by reason: O(dirty pages), not O(entries)."""
    with store._lock:
        wb = store.daemon.stats()
        return {"write_behind": {k: wb[k] for k in ("dirty_pages", "max_dirty_pages", "lag_s", "stranded_pages")},
                "dropped_by_reason": store.counts.snapshot()["dropped_by_reason"]}


def remote_state(store) -> dict:
    """/readyz's view of the remote tier: up, down (its pages are misses meanwhile) or disabled."""
    remote = store.remote
    if remote is None:
        return {"state": "disabled", "last_error": ""}
    return {"state": remote.state, "last_error": remote.last_error}


def get_page(store, key: bytes) -> dict | None:
    with store._lock:
        e = store.index.get(key)
        return None if e is None else _page_json(e, store.index.now(), store.spec.page_size)


def top_prefixes(store, limit: int) -> dict:
    """The most reused prefixes: for each leaf-most page with hits (no child has hits), the chain of
    cached pages back towards the first, ranked by the leaf's hits. O(entries): each page's chain
    summary is computed once, from its parent's."""
    with store._lock:
        entries = store.index.entries
        leaves = [e for e in entries.values()
                  if e.hits and not any(entries[k].hits for k in e.kids if k in entries)]
        top = heapq.nlargest(limit, leaves, key=lambda e: (e.hits, e.depth, e.key))
        chains: dict[bytes, tuple[int, dict[str, int], bool]] = {}   # key -> (pages, tiers, complete)

        def chain(e: PageEntry) -> tuple[int, dict[str, int], bool]:
            path, cur = [], e
            while cur is not None and cur.key not in chains:
                path.append(cur)
                cur = entries.get(cur.parent)
            if cur is not None:
                pages, tiers, complete = chains[cur.key]
            else:   # the topmost cached page: complete if it is the sequence's first
                pages, tiers, complete = 0, dict.fromkeys(TIERS, 0), path[-1].parent == path[-1].namespace
            for p in reversed(path):
                tiers = {**tiers, p.tier: tiers[p.tier] + 1}
                pages += 1
                chains[p.key] = (pages, tiers, complete)
            return chains[e.key]

        prefixes = []
        for e in top:
            pages, tiers, complete = chain(e)
            prefixes.append({"key": e.key.hex(), "namespace": e.namespace.hex(), "pages": pages,
                             "tokens": pages * store.spec.page_size, "hits": e.hits, "complete": complete,
                             "tiers": tiers, "last_access": e.last_access})
    return {"prefixes": prefixes, "page_size": store.spec.page_size}
