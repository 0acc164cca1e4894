"""Long-document QA jobs (`kvstore job run`): many questions over the same documents, each
document's prefix computed once; resumable output, progress, and a report with plots.

    io.py             input JSONL (documents, questions) and the resumable answers / stats files
    runner.py         what the cache-aware runners share: settings, results, the document loop
    engine_runner.py  the runner on an in-process engine
    http_runner.py    the runner against a `kvstore serve` over HTTP
    progress.py       the progress bar (or a line per document)
    report.py         report.md and its PNG plots
    cli.py            the `kvstore job run` command
"""
