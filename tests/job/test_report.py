"""The job report: its totals, and PNG plots that hold the plotted series (checked pixel by pixel
against the series' colours and against a blank render). Also, through a real second job over
the same documents, the prefetch of document prefixes from cold."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from kvstore.job.cli import main
from kvstore.job.report import (MEASURED_COLOR, PLOTS, TIER_COLORS, WITHOUT_CACHE_COLOR, ReportInput, plot_occupancy,
                                plot_time_saved, plot_ttft, write_report)

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
    samples = [{"questions": q, "seconds": q * 0.5, "hot": 10 + 5 * q, "warm": 3 * q, "cold": 40 - q}
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
        rc = main(["run", str(inp), "--out", str(tmp_path / f"job{job}" / "ANSWERS.jsonl"), "--data-dir", str(data),
                   "--report", str(tmp_path / f"report{job}"), *OPTIONS])
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
