"""The sidecar: the store in a process of its own, next to another inference engine, over a Unix
socket, with page bytes in the shared-memory warm tier.

    protocol.py    the wire protocol: frames, ops, field checks, errors
    server.py      SidecarServer: the Unix socket, the ops, draining
    session.py     Session: one connection's leases on warm slots
    command.py     `kvstore sidecar`: config, socket file, shared memory, run
    client.py      SidecarClient, used in the engine's process (client_ops.py: its operations)
"""
