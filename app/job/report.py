"""The job report: report.md with totals, and three PNG plots (matplotlib, Agg backend).

Built from the stats records (ANSWERS.stats.jsonl: every run of the job, the latest record per
item) and the tier occupancy samples (ANSWERS.occupancy.jsonl: every run's):

- ttft_by_tier.png   TTFT of each question in seconds, in question order (the input's documents,
                     then each one's questions), coloured by the tier most of its cached prompt
                     tokens came from ("none": all computed);
- tier_occupancy.png pages in hot, warm and cold over the job's time, sampled on a timer
                     (in-process engine only: with --url the store is the server's);
- time_saved.png     the job's measured time against an estimate without the cache (cumulative,
                     so in the order the questions finished).

Every run (session) of a resumed job is put on one clock: each starts where the last ended,
and lasts until the last answer or sample it recorded.

Time saved against recomputing = cached prompt tokens / the measured prefill speed, the prefill
tokens per second of the lead questions (each runs alone and computes its document's prefix).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

Key = tuple[str, int]   # (document id, question index)

TIER_COLORS = {"none": "#d62728", "hot": "#1f77b4", "warm": "#ff7f0e", "cold": "#2ca02c", "remote": "#17becf", "peer": "#8c564b",
               "cached": "#9467bd"}
TIER_LABELS = {"none": "none (computed)", "hot": "hot", "warm": "warm", "cold": "cold",
               "remote": "remote (the shared store)", "peer": "peer (another instance)", "cached": "cached (tier not reported)"}
MEASURED_COLOR, WITHOUT_CACHE_COLOR = "#1f77b4", "#d62728"
PLOTS = ("ttft_by_tier.png", "tier_occupancy.png", "time_saved.png")
MAX_DOCUMENT_ROWS = 50
MAX_DOCUMENT_SEPARATORS = 100     # lines between documents in the TTFT plot, when there are no more
SEPARATOR_COLOR = "#bbbbbb"
NOT_SAMPLED = "not sampled: with --url the store runs in the server's process"


@dataclass
class ReportInput:
    records: list[dict]                                 # stats, one per finished item
    samples: list[dict] = field(default_factory=list)   # tier occupancy, every run's
    bad_lines: list[str] = field(default_factory=list)  # "line N: why"
    failed: list[str] = field(default_factory=list)     # "line N, document ID, question i: why"
    meta: dict = field(default_factory=dict)            # input, output, target...
    order: list[Key] = field(default_factory=list)      # the input's items, in order


def _key(r: dict) -> Key:
    return str(r["id"]), int(r["question_index"])


def latest(records: list[dict], order: list[Key] | None = None) -> list[dict]:
    """The last record of each item, in question order: `order` (the input's), else documents in the
    order they first appear, then question index."""
    by_key: dict[Key, dict] = {}
    for r in records:
        by_key[_key(r)] = r
    rank = {k: i for i, k in enumerate(order or [])}
    docs: dict[str, int] = {}
    for r in records:
        docs.setdefault(str(r["id"]), len(docs))
    return sorted(by_key.values(), key=lambda r: (rank.get(_key(r), len(rank)), docs[str(r["id"])],
                                                  int(r["question_index"])))


def prefill_speed(records: list[dict]) -> float | None:
    """Prefill tokens per second: of the lead questions, else of every question that computed tokens."""
    for rows in ([r for r in records if r.get("lead")], records):
        rows = [r for r in rows if r["prefill_tokens"] > 0 and r.get("ttft_s")]
        if rows:
            return sum(r["prefill_tokens"] for r in rows) / sum(r["ttft_s"] for r in rows)
    return None


def session_offsets(records: list[dict], samples: list[dict] = ()) -> dict[int, float]:
    """Where each run (session) starts on one clock across runs: each starts where the last ended,
    and lasts until its last answer or sample. The end of the last run is under key -1."""
    ends: dict[int, float] = {}
    for r in records:
        s = r.get("session", 0)
        ends[s] = max(ends.get(s, 0.0), r.get("finished_s") or 0.0)
    for x in samples:
        s = x.get("session", 0)
        ends[s] = max(ends.get(s, 0.0), x.get("seconds") or 0.0)
    offsets, t = {}, 0.0
    for s in sorted(ends):
        offsets[s], t = t, t + ends[s]
    offsets[-1] = t
    return offsets


def job_seconds(records: list[dict], offsets: dict[int, float] | None = None) -> list[float]:
    """Each record's finish time on one clock across runs."""
    offsets = offsets or session_offsets(records)
    return [offsets[r.get("session", 0)] + (r.get("finished_s") or 0.0) for r in records]


def totals(records: list[dict], samples: list[dict] = ()) -> dict:
    speed = prefill_speed(records)
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_total"] for r in records)
    offsets = session_offsets(records, samples)
    docs: dict[str, dict] = {}
    for r in records:
        d = docs.setdefault(str(r["id"]), {"questions": 0, "prefix": r["document_prefix_tokens"], "computed": 0,
                                           "ttft": []})
        d["questions"] += 1
        d["computed"] += r["prefix_tokens_computed"]
        if r.get("ttft_s") is not None:
            d["ttft"].append(r["ttft_s"])
    return {"documents": len(docs), "questions": len(records), "prompt_tokens": prompt,
            "cached_tokens": cached, "prefill_tokens": sum(r["prefill_tokens"] for r in records),
            "generated_tokens": sum(r["generated_tokens"] for r in records),
            "seconds": offsets[-1], "hit_rate": cached / prompt if prompt else 0.0,
            "prefill_tokens_per_s": speed, "saved_s": cached / speed if speed else None,
            "sessions": len({r.get("session", 0) for r in records}), "per_document": docs}


def _fmt(x, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    return f"{x:,}" if isinstance(x, int) else f"{x:,.0f}" if abs(x) >= 100 else f"{x:.{digits}g}"


def _tier(record: dict) -> str:
    return record["tier"] if record["tier"] in TIER_COLORS else "cached"


def _figure():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.grid(True, alpha=0.3)
    return plt, fig, ax


def _count_axis(ax) -> None:
    """Whole numbers on the x axis (it counts questions)."""
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_ttft(records: list[dict], path: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Plot the records' TTFT in seconds against their position (records in question order);
    returns what it plotted: tier -> (positions, seconds)."""
    plt, fig, ax = _figure()
    series: dict[str, tuple[list[int], list[float]]] = {}
    for i, r in enumerate(records, start=1):
        if r.get("ttft_s") is not None:
            xs, ys = series.setdefault(_tier(r), ([], []))
            xs.append(i)
            ys.append(r["ttft_s"])
    starts = [i for i in range(2, len(records) + 1) if records[i - 1]["id"] != records[i - 2]["id"]]
    separated = len(starts) < MAX_DOCUMENT_SEPARATORS
    for i in starts if separated else []:
        ax.axvline(i - 0.5, color=SEPARATOR_COLOR, linewidth=0.8, zorder=0)
    values = [y for _, ys in series.values() for y in ys]
    for tier, color in TIER_COLORS.items():
        if tier in series:
            xs, ys = series[tier]
            ax.scatter(xs, ys, s=28, color=color, label=f"{TIER_LABELS[tier]} ({len(xs)})", edgecolors="none")
    if values and min(values) > 0 and max(values) / min(values) > 20:
        ax.set_yscale("log")
    ax.set_xlabel("question (input order: by document, then question"
                  + ("; grey lines between documents)" if separated and starts else ")"))
    ax.set_ylabel("time to first token (s)")
    _count_axis(ax)
    ax.set_title("TTFT per question, by the tier its cached prefix came from")
    if values:
        ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return series


def plot_occupancy(samples: list[dict], path: Path, note: str = "",
                   offsets: dict[int, float] | None = None) -> tuple[list[float], dict[str, list[int]]]:
    """Plot the pages in each tier over the job's time (every run on one clock, `offsets`);
    returns what it plotted: (seconds, tier -> pages)."""
    plt, fig, ax = _figure()
    offsets = offsets or session_offsets([], samples)
    rows = sorted(((offsets.get(s.get("session", 0), 0.0) + s["seconds"], s) for s in samples), key=lambda p: p[0])
    xs = [t for t, _ in rows]
    pages = {tier: [s[tier] for _, s in rows] for tier in ("hot", "warm", "cold")}
    if rows:
        resumed = sorted({offsets.get(s.get("session", 0), 0.0) for s in samples} - {0.0})
        for i, t in enumerate(resumed):
            ax.axvline(t, color=SEPARATOR_COLOR, linewidth=1.2, linestyle="--", zorder=0,
                       label="run resumed" if i == 0 else None)
        for tier, style in (("hot", "-"), ("warm", "--"), ("cold", ":")):   # styles: equal counts overlap
            ax.plot(xs, pages[tier], color=TIER_COLORS[tier], linewidth=2.5, linestyle=style,
                    label=tier, marker="o", markersize=3)
        ax.legend(loc="best")
    else:
        ax.text(0.5, 0.5, note or "no samples", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("seconds since the job started (all runs)")
    ax.set_ylabel("pages")
    ax.set_title("Tier occupancy over the job")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return xs, pages


def plot_time_saved(records: list[dict], speed: float | None, path: Path,
                    offsets: dict[int, float] | None = None) -> None:
    plt, fig, ax = _figure()
    rows = sorted(zip(job_seconds(records, offsets), records), key=lambda p: p[0])   # in the order they finished
    measured, records = [t for t, _ in rows], [r for _, r in rows]
    xs = list(range(1, len(records) + 1))
    if records:
        saved, acc = [], 0.0
        for r in records:
            acc += r["cached_total"] / speed if speed else 0.0
            saved.append(acc)
        without = [m + s for m, s in zip(measured, saved)]
        ax.plot(xs, measured, color=MEASURED_COLOR, linewidth=2.5, label="measured")
        ax.plot(xs, without, color=WITHOUT_CACHE_COLOR, linewidth=2.5, label="estimated without the cache")
        ax.fill_between(xs, measured, without, color=TIER_COLORS["cold"], alpha=0.25,
                        label=f"saved: {saved[-1]:.3g} s")
        ax.legend(loc="upper left")
    ax.set_xlabel("questions answered (in the order they finished)")
    ax.set_ylabel("cumulative seconds")
    _count_axis(ax)
    ax.set_title("Time saved against recomputing every prefix")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(data: ReportInput, out_dir: str | Path) -> Path:
    """Write report.md and the plots into out_dir; returns report.md's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = latest(data.records, data.order)
    t = totals(records, data.samples)
    offsets = session_offsets(records, data.samples)
    remote = data.meta.get("target", "").startswith("http")
    plot_ttft(records, out_dir / PLOTS[0])
    plot_occupancy(data.samples, out_dir / PLOTS[1], note=NOT_SAMPLED if remote else "", offsets=offsets)
    plot_time_saved(records, t["prefill_tokens_per_s"], out_dir / PLOTS[2], offsets)

    m = data.meta
    lines = ["# Job report", ""]
    for label, key in (("input", "input"), ("answers", "output"), ("stats", "stats"), ("target", "target"),
                       ("status", "status")):
        if m.get(key):
            lines.append(f"- {label}: `{m[key]}`" if key != "status" else f"- {label}: {m[key]}")
    lines += ["", "## Totals", "", "| | |", "|---|---|",
              f"| documents | {t['documents']:,} |", f"| questions answered | {t['questions']:,} |",
              f"| prompt tokens | {t['prompt_tokens']:,} |",
              f"| served from the cache | {t['cached_tokens']:,} ({t['hit_rate']:.1%} cache hit rate) |",
              f"| computed (prefill) | {t['prefill_tokens']:,} |",
              f"| generated tokens | {t['generated_tokens']:,} |",
              f"| time | {t['seconds']:.3g} s over {t['sessions']} run(s) |",
              f"| measured prefill speed | {_fmt(t['prefill_tokens_per_s'])} tokens/s |",
              f"| estimated time saved against recomputing | {_fmt(t['saved_s'])} s |", ""]
    lines += ["## Time to first token by cache tier", "", "| tier | questions | mean TTFT (s) | median TTFT (s) |",
              "|---|---|---|---|"]
    for tier in TIER_COLORS:
        ttfts = [r["ttft_s"] for r in records if _tier(r) == tier and r.get("ttft_s") is not None]
        if ttfts:
            lines.append(f"| {TIER_LABELS[tier]} | {len(ttfts)} | {statistics.fmean(ttfts):.4g} | "
                         f"{statistics.median(ttfts):.4g} |")
    lines += ["", "## Documents", "",
              "Prefix prefills: the tokens of the document's full pages computed, over all its questions, "
              "divided by their number (1: computed once; 0: it came from the cache).", "",
              "| document | questions | prefix tokens | prefix prefills | mean TTFT (s) |", "|---|---|---|---|---|"]
    docs = list(t["per_document"].items())
    for doc_id, d in docs[:MAX_DOCUMENT_ROWS]:
        prefills = f"{d['computed'] / d['prefix']:.3g}" if d["prefix"] else "n/a"
        mean = f"{statistics.fmean(d['ttft']):.4g}" if d["ttft"] else "n/a"
        lines.append(f"| {doc_id} | {d['questions']} | {d['prefix']:,} | {prefills} | {mean} |")
    if len(docs) > MAX_DOCUMENT_ROWS:
        lines.append(f"\n{len(docs) - MAX_DOCUMENT_ROWS} more documents (see the stats file).")
    lines += ["", "## Problems", ""]
    if not (data.bad_lines or data.failed):
        lines.append("None: every input line was read and every question answered.")
    if data.bad_lines:
        lines += [f"{len(data.bad_lines)} bad input line(s), skipped:", ""] + [f"- {b}" for b in data.bad_lines] + [""]
    if data.failed:
        lines += [f"{len(data.failed)} question(s) failed (not written; a new run retries them):", ""]
        lines += [f"- {f}" for f in data.failed] + [""]
    lines += ["", "## Plots", "", "![TTFT per question by cache tier](ttft_by_tier.png)", ""]
    if not data.samples:
        lines += ["Tier occupancy is only sampled with the in-process engine (with --url the store runs in the "
                  "server's process)." if remote else "No tier occupancy samples were recorded for this job.", ""]
    lines += ["![Tier occupancy over the job](tier_occupancy.png)", "",
              "![Time saved against recomputing](time_saved.png)", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
