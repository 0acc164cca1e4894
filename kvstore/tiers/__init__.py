"""The three tiers: hot (device.py), warm (host.py), cold (disk.py; lmdb_file.py reads its LMDB file
without mapping it, to check and salvage it)."""
