"""The job report: its totals, and PNG plots that hold the plotted series (checked pixel by pixel
against the series' colours and against a blank render): TTFT in seconds and in question order,
tier occupancy as one time series over every run of a resumed job. Also, through real jobs, the
occupancy sampled on a timer, and the prefetch of document prefixes from cold."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from app.job.cli import main
from app.job.io import read_stats
from app.job.report import (MEASURED_COLOR, PLOTS, TIER_COLORS, WITHOUT_CACHE_COLOR, ReportInput, latest,
                                plot_occupancy, plot_time_saved, plot_ttft, session_offsets, write_report)

OPTIONS = ["--max-tokens", "6", "--set", "hot.device=cpu", "--set", "hot.pool=512KiB", "--set", "warm.bytes=4MiB",
           "--progress", "none"]


@pytest.fixture(autouse=True)
def one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pixels_of(image: np.ndarray, color: str, tol: float = 0.03) -> int:
    """Pixels of `image` (RGB or RGBA floats) within tol of `color` in every channel."""
    rgb = np.array(to_rgb(color))
    return int((np.abs(image[..., :3] - rgb) <= tol).all(axis=-1).sum())


def distinct_colors(image: np.ndarray) -> int:
    return len(np.unique((image[..., :3] * 255).round().astype(np.uint8).reshape(-1, 3), axis=0))


def record(i: int, tier: str, lead: bool, session: int = 1) -> dict:
    cached = {"hot": 0, "warm": 0, "cold": 0}
    if tier != "none":
        cached[tier] = 1000
    total = sum(cached.values())
    return {"id": f"d{i // 4}", "question_index": i % 4, "session": session, "lead": lead, "tier": tier,
            "prompt_tokens": 1000, "cached_tokens": cached, "cached_total": total, "prefill_tokens": 1000 - total,
            "generated_tokens": 8, "ttft_s": 1.0 if tier == "none" else 0.02 + 0.001 * i, "seconds": 1.2,
            "document_prefix_tokens": 960, "prefix_tokens_computed": 960 - min(total, 960),
            "finished_s": 0.5 * (i + 1)}


def synthetic() -> ReportInput:
    tiers = ["none", "hot", "hot", "hot", "none", "warm", "warm", "hot", "cold", "cold", "hot", "hot"]
    records = [record(i, t, i % 4 == 0) for i, t in enumerate(tiers)]
    samples = [{"session": 1, "questions": q, "seconds": q * 0.5, "hot": 10 + 5 * q, "warm": 3 * q, "cold": 40 - q}
               for q in range(0, 13, 2)]
    return ReportInput(records, samples, ["line 7: not valid JSON"], ["line 3, document 'x', question 1: too long"],
                       {"input": "in.jsonl", "output": "ANSWERS.jsonl", "target": "in-process engine, model tiny"})


def test_report_totals(tmp_path):
    path = write_report(synthetic(), tmp_path)
    text = path.read_text()
    # 10 of 12 questions fully cached; the 2 computed leads prefill 1000 tokens in 1 s each: 1000 tokens/s
    assert "| documents | 3 |" in text and "| questions answered | 12 |" in text
    assert "| served from the cache | 10,000 (83.3% cache hit rate) |" in text
    assert "| measured prefill speed | 1,000 tokens/s |" in text
    assert "| estimated time saved against recomputing | 10 s |" in text
    assert "| time | 6 s over 1 run(s) |" in text
    assert "| none (computed) | 2 | 1 | 1 |" in text and "| cold | 2 |" in text
    assert "| d0 | 4 | 960 | 1 |" in text and "| d2 | 4 | 960 | 0 |" in text   # d2's lead came from cold
    assert "- line 7: not valid JSON" in text and "- line 3, document 'x', question 1: too long" in text
    for name in PLOTS:
        assert f"]({name})" in text and (tmp_path / name).stat().st_size > 10_000


def test_plots_hold_their_series(tmp_path):
    data = synthetic()
    write_report(data, tmp_path)
    plot_ttft([], tmp_path / "blank_ttft.png")
    plot_occupancy([], tmp_path / "blank_occupancy.png")
    plot_time_saved([], None, tmp_path / "blank_saved.png")
    series = {"ttft_by_tier.png": ([TIER_COLORS[t] for t in ("none", "hot", "warm", "cold")], "blank_ttft.png"),
              "tier_occupancy.png": ([TIER_COLORS[t] for t in ("hot", "warm", "cold")], "blank_occupancy.png"),
              "time_saved.png": ([MEASURED_COLOR, WITHOUT_CACHE_COLOR], "blank_saved.png")}
    for name, (colors, blank_name) in series.items():
        image, blank = imread(tmp_path / name), imread(tmp_path / blank_name)
        assert image.shape == blank.shape and image.shape[0] >= 300 and image.shape[1] >= 600
        assert distinct_colors(image) > 20, name
        for color in colors:
            assert pixels_of(image, color) >= 40, (name, color)
            assert pixels_of(blank, color) < 5, (blank_name, color)   # the series, not the frame
        changed = (np.abs(image[..., :3] - blank[..., :3]) > 0.1).any(axis=-1).mean()
        assert changed > 0.01, (name, changed)


def test_second_job_over_the_same_documents_prefetches_from_cold_and_reports(tmp_path, capsys):
    words = "north south east west river mountain valley forest".split()
    docs = [" ".join(words[(i + j) % 8] for j in range(45)) + f" (document {i})" for i in range(5)]
    data = tmp_path / "data"
    for job in (1, 2):
        inp = tmp_path / f"job{job}.jsonl"
        inp.write_text("".join(json.dumps({"id": f"d{i}", "document": d,
                                           "questions": [f"Round {job}: question {j}?" for j in range(3)]}) + "\n"
                               for i, d in enumerate(docs)))
        # sdpa: a prefix found in warm is copied up to hot, so the leads come from warm and the other
        # questions from hot (native would attend the prefix in warm for all of them)
        rc = main(["run", str(inp), "--out", str(tmp_path / f"job{job}" / "ANSWERS.jsonl"), "--data-dir", str(data),
                   "--report", str(tmp_path / f"report{job}"), *OPTIONS, "--set", "engine.attention_backend=sdpa"])
        assert rc == 0, capsys.readouterr().err

    first = [json.loads(line) for line in (tmp_path / "job1" / "ANSWERS.stats.jsonl").read_text().splitlines()]
    second = [json.loads(line) for line in (tmp_path / "job2" / "ANSWERS.stats.jsonl").read_text().splitlines()]
    assert all(s["tier"] == "none" for s in first if s["lead"])
    assert {s["id"]: s["prefix_tokens_computed"] for s in first if s["lead"]} == \
        {s["id"]: s["document_prefix_tokens"] for s in first if s["lead"]}
    # job 1 closed its store: every prefix went to cold; job 2 prefetched each into warm before it ran
    leads = [s for s in second if s["lead"]]
    assert len(leads) == 5
    for s in leads:
        assert s["tier"] == "warm" and s["cached_tokens"]["warm"] >= s["document_prefix_tokens"], s
        assert s["prefetched_pages"] == s["document_prefix_tokens"] // 16
    assert sum(s["prefix_tokens_computed"] for s in second) == 0

    text = (tmp_path / "report2" / "report.md").read_text()
    assert "| documents | 5 |" in text and "| questions answered | 15 |" in text
    assert "| warm | 5 |" in text and "| hot | 10 |" in text
    ttft, occupancy = imread(tmp_path / "report2" / PLOTS[0]), imread(tmp_path / "report2" / PLOTS[1])
    assert pixels_of(ttft, TIER_COLORS["warm"]) >= 40 and pixels_of(ttft, TIER_COLORS["hot"]) >= 40
    for tier in ("hot", "warm", "cold"):
        assert pixels_of(occupancy, TIER_COLORS[tier]) >= 40, tier


def test_ttft_is_plotted_in_seconds_in_question_order(tmp_path):
    # a resumed job: run 1 answered d1 and d0's question 2, run 2 the rest of d0, question 1 first
    finished = [("d1", 0, 1, 0.4), ("d1", 1, 1, 0.9), ("d0", 2, 1, 1.5), ("d0", 1, 2, 0.7), ("d0", 0, 2, 2.2)]
    records = []
    for n, (doc, q, session, at) in enumerate(finished):
        r = record(0, "hot" if q else "none", q == 0, session)
        r.update(id=doc, question_index=q, finished_s=at, ttft_s=1.25 + n if q == 0 else 0.03 + 0.01 * n)
        records.append(r)
    order = [("d0", 0), ("d0", 1), ("d0", 2), ("d1", 0), ("d1", 1)]
    rows = latest(records, order)
    assert [(r["id"], r["question_index"]) for r in rows] == order
    series = plot_ttft(rows, tmp_path / "ttft.png")
    plotted = sorted((x, y, tier) for tier, (xs, ys) in series.items() for x, y in zip(xs, ys))
    by_key = {(r["id"], r["question_index"]): r for r in records}
    assert plotted == [(i, by_key[k]["ttft_s"], "none" if k[1] == 0 else "hot") for i, k in enumerate(order, start=1)]
    assert plotted[0][1] == 5.25 and plotted[1][1] == 0.06     # seconds, as recorded (not ms)
    # without the input's order: documents as they first appear, then question index
    assert [(r["id"], r["question_index"]) for r in latest(records)] == [("d1", 0), ("d1", 1), ("d0", 0), ("d0", 1),
                                                                         ("d0", 2)]
    text = write_report(ReportInput(records, order=order), tmp_path / "report").read_text()
    assert text.index("| d0 |") < text.index("| d1 |")


def test_occupancy_of_a_resumed_job_is_one_time_series(tmp_path):
    samples = [{"session": 1, "seconds": 0.5 * i, "questions": i, "hot": 10 + i, "warm": i, "cold": 5}
               for i in range(7)]
    samples += [{"session": 2, "seconds": 0.5 * i, "questions": i, "hot": 3 + i, "warm": 2, "cold": 20}
                for i in range(5)]
    records = [record(0, "none", True, session=1), record(1, "hot", False, session=2)]
    records[0]["finished_s"], records[1]["finished_s"] = 2.8, 2.1
    offsets = session_offsets(records, samples)
    assert offsets[1] == 0.0 and offsets[2] == 3.0     # run 1 lasted until its last sample, at 3 s
    xs, pages = plot_occupancy(samples, tmp_path / "occupancy.png", offsets=offsets)
    assert xs == [0.5 * i for i in range(7)] + [3.0 + 0.5 * i for i in range(5)]
    assert pages["hot"] == [10 + i for i in range(7)] + [3 + i for i in range(5)]
    data = ReportInput(records, samples)
    assert "| time | 5.1 s over 2 run(s) |" in write_report(data, tmp_path / "report").read_text()


def test_occupancy_is_sampled_on_a_timer_and_a_resumed_job_keeps_one_time_series(tmp_path, capsys):
    words = "red green blue cyan magenta yellow black white".split()
    docs = [{"id": f"d{i}", "document": " ".join(words[(i * 3 + j) % 8] for j in range(70)),
             "questions": [f"Question {j}?" for j in range(4)]} for i in range(6)]
    out = tmp_path / "job" / "ANSWERS.jsonl"
    every = 0.1         # --sample-interval
    for run, n in ((1, 3), (2, 6)):       # run 2 resumes: the first three documents are answered already
        inp = tmp_path / f"in{run}.jsonl"
        inp.write_text("".join(json.dumps(d) + "\n" for d in docs[:n]))
        rc = main(["run", str(inp), "--out", str(out), "--data-dir", str(tmp_path / "data"),
                   "--report", str(tmp_path / f"report{run}"), *OPTIONS, "--max-tokens", "160",
                   "--sample-interval", str(every)])
        assert rc == 0, capsys.readouterr().err

    samples = read_stats(out.with_name("ANSWERS.occupancy.jsonl"))
    assert {s["session"] for s in samples} == {1, 2}
    for session in (1, 2):
        rows = [s for s in samples if s["session"] == session]
        seconds = [s["seconds"] for s in rows]
        assert seconds == sorted(seconds) and seconds[0] < every
        # a sample at the start, at the end, and one at every multiple of the interval in between (skipped
        # when late on a busy machine): their number follows the run's time, not its questions
        ticks, expected = seconds[1:-1], int(seconds[-1] / every)
        assert 0.6 * expected - 1 <= len(ticks) <= expected and len(ticks) >= 1, seconds
        assert rows[0]["questions"] == 0 and rows[-1]["questions"] == 12
        assert rows[-1]["hot"] > 0

    records = read_stats(out.with_name("ANSWERS.stats.jsonl"))
    offsets = session_offsets(records, samples)
    xs, pages = plot_occupancy(samples, tmp_path / "occupancy.png", offsets=offsets)
    assert len(xs) == len(samples) and xs == sorted(xs)
    assert xs[-1] == offsets[-1] and offsets[2] >= max(s["seconds"] for s in samples if s["session"] == 1)
    occupancy = imread(tmp_path / "report2" / PLOTS[1])
    assert pixels_of(occupancy, TIER_COLORS["hot"]) >= 40
    assert "over 2 run(s)" in (tmp_path / "report2" / "report.md").read_text()
