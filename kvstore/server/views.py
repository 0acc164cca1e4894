"""Views of the store's index for the admin API, built in a worker thread from one snapshot of the
store (TieredStore.snapshot: taken under its lock, which the views never take)."""

from __future__ import annotations

import heapq

from kvstore.placement.index import TIERS
from kvstore.store.snapshot import PageView


def _page_json(e: PageView, now: float, page_size: int) -> dict:
    pinned = e.pinned(now)
    return {"key": e.key.hex(), "parent": e.parent.hex(), "namespace": e.namespace.hex(), "depth": e.depth,
            "tokens": page_size, "tier": e.tier, "tiers": list(e.tiers),
            "refcount": e.refcount, "pinned": pinned,
            "pin_remaining_s": round(e.pin_until - now, 3) if pinned else None,
            "hits": e.hits, "last_access": e.last_access, "children": e.children}


def list_pages(store, tier: str | None, namespace: bytes | None, pinned: bool | None, limit: int,
               cursor: bytes | None) -> dict:
    """Pages matching the filters, in key order, `limit` after `cursor`: O(entries log limit), or of
    the tier's pages when one is given (only those are copied)."""
    snap = store.snapshot(pages=True, tier=tier)
    now = snap.now
    matching = [e for e in snap.pages.values()
                if (namespace is None or e.namespace == namespace) and (pinned is None or e.pinned(now) == pinned)]
    after = matching if cursor is None else [e for e in matching if e.key > cursor]
    chosen = heapq.nsmallest(limit + 1, after, key=lambda e: e.key)
    pages = [_page_json(e, now, snap.page_size) for e in chosen[:limit]]
    return {"pages": pages, "next_cursor": pages[-1]["key"] if len(chosen) > limit else None,
            "total": len(matching)}


def write_health(store) -> dict:
    """/readyz's view of write-behind (the dirty pages against their bound, the oldest one's age,
    pages cold refused) and of the pages dropped, by reason: O(dirty pages), not O(entries)."""
    snap = store.snapshot()
    wb = snap.write_behind
    return {"write_behind": {k: wb[k] for k in ("dirty_pages", "max_dirty_pages", "lag_s", "stranded_pages")},
            "dropped_by_reason": dict(snap.dropped_by_reason)}


def remote_state(store) -> dict:
    """/readyz's view of the remote tier: up, down (its pages are misses meanwhile) or disabled."""
    remote = store.remote
    if remote is None:
        return {"state": "disabled", "last_error": ""}
    return {"state": remote.state, "last_error": remote.last_error}


def get_page(store, key: bytes) -> dict | None:
    snap = store.snapshot(pages=[key])
    e = snap.pages.get(key)
    return None if e is None else _page_json(e, snap.now, snap.page_size)


def top_prefixes(store, limit: int) -> dict:
    """The most reused prefixes: for each leaf-most page with hits (no child has hits), the chain of
    cached pages back towards the first, ranked by the leaf's hits. O(entries): each page's chain
    summary is computed once, from its parent's."""
    snap = store.snapshot(pages=True)
    entries = snap.pages
    hit_parents = {e.parent for e in entries.values() if e.hits}   # pages with a child that has hits
    leaves = [e for e in entries.values() if e.hits and e.key not in hit_parents]
    top = heapq.nlargest(limit, leaves, key=lambda e: (e.hits, e.depth, e.key))
    chains: dict[bytes, tuple[int, dict[str, int], bool]] = {}   # key -> (pages, tiers, complete)

    def chain(e: PageView) -> tuple[int, dict[str, int], bool]:
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
                         "tokens": pages * snap.page_size, "hits": e.hits, "complete": complete,
                         "tiers": tiers, "last_access": e.last_access})
    return {"prefixes": prefixes, "page_size": snap.page_size}
