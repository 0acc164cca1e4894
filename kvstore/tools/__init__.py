"""The operator's tools, each a `kvstore` subcommand over the store alone.

    plan.py      `kvstore plan`: KV pool capacity for a model, a context and a concurrency
    fsck.py      `kvstore fsck`: check (and repair) every record of the cold tier
    inspect.py   `kvstore inspect`: a client of a running instance's admin API
    bench.py     `kvstore bench tiers`: page throughput between the tiers against baselines
"""
