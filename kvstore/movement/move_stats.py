"""MoveStats: the one place that counts what happens to pages, reported by the mover and the store.

Everything goes through `count(event, tier, pages=1, to=None)`:

    hit, miss        a page asked for in `tier` was there, or was not
    promote          a page came up into `tier` from a lower one
    evict            a page's copy left `tier`
    move             pages were copied from `tier` to tier `to` (bytes_moved["<tier>_to_<to>"])
    corrupt          a cold record failed verification (also a cold miss)
    drop             cached pages left the store with no copy below, by reason (DROP_REASONS):
                     no_cold_tier (a store without one), cold_full (cold at its limit could not
                     evict for them), write_error (the disk failed their writes)
    mismatch         a key matched but its page did not (tokens, parent or namespace)

Drops are also logged, with backoff (LogBackoff: the first at once, then at most one line per
growing interval with the count since), naming the reasons.

`snapshot()` gives what store.stats() reports: counters per tier, bytes moved per direction
(every pair of tiers, nearest first, then each source into the second tier: remote_to_warm, peer_to_warm),
corrupt, dropped and mismatched pages. The caller holds the store's lock.
"""

from __future__ import annotations

import logging
from typing import Sequence

from kvstore.logbackoff import LogBackoff
from kvstore.placement.index import SOURCES

log = logging.getLogger("kvstore.store")

COUNTERS = ("hits", "misses", "evictions", "promotions")
DROP_REASONS = ("no_cold_tier", "cold_full", "write_error")
_PER_TIER = {"hit": "hits", "miss": "misses", "evict": "evictions", "promote": "promotions"}


def directions(tiers: Sequence[str], sources: Sequence[str] = SOURCES) -> tuple[str, ...]:
    """hot_to_warm, warm_to_hot, warm_to_cold, cold_to_warm, hot_to_cold, cold_to_hot, remote_to_warm, peer_to_warm
    for the built-in tiers: pairs one apart first, down then up, then those further apart."""
    out = [f"{a}_to_{b}" for gap in range(1, len(tiers)) for i in range(len(tiers) - gap)
           for a, b in ((tiers[i], tiers[i + gap]), (tiers[i + gap], tiers[i]))]
    return (*out, *(f"{s}_to_{tiers[1]}" for s in sources))


class MoveStats:
    def __init__(self, tiers: Sequence[str], page_bytes: int, sources: Sequence[str] = SOURCES):
        self.page_bytes = page_bytes
        self.tiers = {t: dict.fromkeys(COUNTERS, 0) for t in tiers}
        self.bytes_moved = dict.fromkeys(directions(tiers, sources), 0)
        self.pages = {"corrupt": 0, "drop": 0, "mismatch": 0}
        self.drops = dict.fromkeys(DROP_REASONS, 0)
        self._drop_log = LogBackoff()
        self._dropped_since: dict[str, int] = {}

    def count(self, event: str, tier: str | None = None, pages: int = 1, to: str | None = None,
              reason: str | None = None) -> None:
        if event == "drop":
            self.drops[reason] += pages
            self._log_drop(reason, pages)
        if event == "move":
            self.bytes_moved[f"{tier}_to_{to}"] += pages * self.page_bytes
        elif event in _PER_TIER:
            self.tiers[tier][_PER_TIER[event]] += pages
        else:
            if event == "corrupt" and tier in self.tiers:
                self.tiers[tier]["misses"] += pages
            self.pages[event] += pages

    def _log_drop(self, reason: str, pages: int) -> None:
        self._dropped_since[reason] = self._dropped_since.get(reason, 0) + pages
        if self._drop_log.due(pages):
            why = ", ".join(f"{n} {r}" for r, n in sorted(self._dropped_since.items()))
            # a store without a cold tier evicts that way: news, not a warning
            level = logging.INFO if set(self._dropped_since) == {"no_cold_tier"} else logging.WARNING
            log.log(level, "pages dropped from memory with no copy in a lower tier (%s) since the last report; "
                    "%d in all", why, self.pages["drop"] + pages)
            self._dropped_since = {}

    def snapshot(self) -> dict:
        return {"tiers": {t: dict(c) for t, c in self.tiers.items()}, "bytes_moved": dict(self.bytes_moved),
                "corrupt_pages": self.pages["corrupt"], "dropped_pages": self.pages["drop"],
                "dropped_by_reason": dict(self.drops),
                "mismatched_pages": self.pages["mismatch"]}
