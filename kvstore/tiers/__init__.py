"""The three tiers: hot (device.py), warm (host.py), cold (disk.py)."""
