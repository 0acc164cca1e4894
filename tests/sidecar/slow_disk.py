"""A `kvstore sidecar` whose disk is slower than its clients: the built-in cold tier (LMDB) with every
write transaction held back KVSTORE_TEST_COMMIT_DELAY_S seconds, registered as the tier backend
`slow-lmdb` (the same registry a plugin's backend uses), then the kvstore command as usual:

    python tests/sidecar/slow_disk.py sidecar --set cold.backend=slow-lmdb ...
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvstore.cli import main  # noqa: E402
from kvstore.tiers.base import TIER_BACKENDS  # noqa: E402
from kvstore.tiers.disk import DiskTier  # noqa: E402
from kvstore.tiers.lmdb_writer import LmdbWriter  # noqa: E402

DELAY_S = float(os.environ.get("SLOW_DISK_COMMIT_DELAY_S", "0.5"))


class SlowWriter(LmdbWriter):
    def _commit(self, batch) -> None:
        if any(r.puts for r in batch):
            time.sleep(DELAY_S)
        super()._commit(batch)


class SlowDiskTier(DiskTier):
    writer_type = SlowWriter


@TIER_BACKENDS.register("slow-lmdb")
def slow_tier(role, spec, path, max_bytes, map_size_max, write_batch=64, **_):
    tier = SlowDiskTier(path, spec, max_bytes, map_size_max, write_batch)
    tier.name = role
    return tier


if __name__ == "__main__":
    sys.exit(main())
