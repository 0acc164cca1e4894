"""The tiers behind one interface (base.py): hot (device.py), warm (host.py), cold (disk.py: its
writer lmdb_writer.py and its reader lmdb_reader.py, on the LMDB environment of lmdb_env.py;
lmdb_file.py reads its file without mapping it, to check and salvage it), a peer's pages as a
read-only source (peer_pages.py); build.py makes the store's list from the config through the
registry."""
