"""LogBackoff: one log line for an event that repeats (a failing disk, pages dropped), not one each
time: the first at once, then at most one per interval, which doubles from `first_s` up to
`longest_s`, each with the count since the line before."""

from __future__ import annotations

import time


class LogBackoff:
    def __init__(self, first_s: float = 5.0, longest_s: float = 300.0):
        self.first_s, self.longest_s = first_s, longest_s
        self.interval = first_s
        self.next = 0.0
        self.unlogged = 0

    def due(self, n: int = 1) -> int:
        """Count n events; when a line is due now, the events since the last one (else 0)."""
        self.unlogged += n
        now = time.monotonic()
        if now < self.next:
            return 0
        count, self.unlogged = self.unlogged, 0
        self.next = now + self.interval
        self.interval = min(2 * self.interval, self.longest_s)
        return count

    def reset(self) -> None:
        """The events stopped: the next one is logged at once again, the interval starts over."""
        self.interval, self.next, self.unlogged = self.first_s, 0.0, 0
