"""The remote tier behind `kvstore job`: a second job on a fresh data directory reads the documents'
prefixes that the first one wrote to a shared redis-server, and answers the same."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "job"))
from app.job.cli import main  # noqa: E402
from redisutil import RedisServer  # noqa: E402
from test_job import FAST, document, one_torch_thread, questions, read_jsonl, write_input  # noqa: E402,F401


def test_a_job_on_a_fresh_data_directory_reads_the_prefixes_from_the_remote_tier(tmp_path, capsys):
    server = RedisServer(tmp_path / "redis")
    try:
        docs = [{"id": f"doc-{i}", "document": document(i, 60), "questions": questions(i, 2)} for i in range(4)]
        inp = write_input(tmp_path / "in.jsonl", docs)
        runs = {}
        for name in ("a", "b"):
            out = tmp_path / name / "ANSWERS.jsonl"
            rc = main(["run", str(inp), "--out", str(out), "--max-tokens", "6", "--data-dir", str(tmp_path / name),
                       "--set", f"remote.url={server.url}", *FAST])
            assert rc == 0, capsys.readouterr().err
            runs[name] = (read_jsonl(out), read_jsonl(out.with_name("ANSWERS.stats.jsonl")))
        assert [a["token_ids"] for a in runs["b"][0]] == [a["token_ids"] for a in runs["a"][0]]
        first, second = ([s for s in stats if s["lead"]] for _, stats in (runs["a"], runs["b"]))
        assert all(s["cached_total"] == 0 for s in first)
        # the fresh job computes no document prefix: every full page of it came from the remote tier
        assert all(s["prefix_tokens_computed"] == 0 and s["cached_total"] >= s["document_prefix_tokens"] > 0
                   for s in second), second
    finally:
        server.stop()
