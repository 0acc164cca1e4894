"""The application: the programs built on the engine (engine/) and the store (kvstore/).

    app/cli.py    the `kvstore` command: the store's commands (kvstore.cli) plus serve and job
    app/serve.py  `kvstore serve`: store, engine, OpenAI API and admin API in one process
    app/api/      the OpenAI-compatible HTTP API over the engine (and its config section)
    app/job/      `kvstore job run`: long-document QA jobs
    app/bench/    the engine benchmarks (scripts/bench_engine)

The layers go one way: app imports engine and kvstore, engine imports kvstore, kvstore imports
neither (tests/test_layers.py walks the imports).
"""
