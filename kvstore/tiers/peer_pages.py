"""PeerPages: pages another instance sent, a read-only tier the mover reads
from into warm.

A peer fetch (cluster/peer.py) verifies each record it receives and hands the chain to the store
as one PeerPages; the mover then reads it into warm through the tier interface, like any lower
tier, and counts the bytes as `peer_to_warm`. Handles are RecordHeaders (keyed); a read copies
a page only when its stored header is exactly the one asked for. It lives for one import.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Sequence

from kvstore.pages.record import RecordHeader
from kvstore.pages.spec import KVSpec
from kvstore.tiers.base import Tier, done


class PeerPages(Tier):
    name = "peer"
    keyed = True
    writable = False

    def __init__(self, spec: KVSpec, records: Sequence[tuple[RecordHeader, bytes]], name: str = "peer"):
        super().__init__(spec)
        self.name = name
        self.records = {h.key: (h, payload) for h, payload in records}

    @property
    def capacity_bytes(self) -> int:
        return self.used_bytes

    @property
    def used_bytes(self) -> int:
        return len(self.records) * self.spec.page_bytes

    def contains(self, handles: Sequence) -> list[bool]:
        return [getattr(h, "key", h) in self.records for h in handles]

    def read_into(self, handles: Sequence[RecordHeader], dst, dst_slots: Sequence[int]) -> Future:
        ok = []
        for h in handles:
            header, _ = self.records.get(h.key, (None, None))
            ok.append(header == h and len(self.records[h.key][1]) == self.spec.page_bytes)
        dst.store_pages([s for s, good in zip(dst_slots, ok) if good],
                        [self.records[h.key][1] for h, good in zip(handles, ok) if good])
        return done(ok)
