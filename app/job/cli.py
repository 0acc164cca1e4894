"""`kvstore job run INPUT.jsonl --out ANSWERS.jsonl [--report DIR]`: a long-document QA job.

Also runnable as `python -m app.job.cli run ...`.
"""

from __future__ import annotations

import argparse
import functools
import json
import signal
import sys
import threading
import urllib.request

from kvstore.config import add_config_options, config_from_args
from kvstore.errors import ConfigError, KVStoreError
from kvstore.heap import frozen
from app.job.io import AnswerLog, read_input, read_stats
from app.job.progress import MODES, Progress

DESCRIPTION = """\
Answer many questions over long documents, each document's prefix computed once.

INPUT is JSONL, one document a line:
  {"id": "doc-1", "document": "text, or @path/to/file.txt", "questions": ["...", "..."],
   "max_tokens": 64, "temperature": 0.0, "seed": 1, "tenant": "acme"}   (the last four optional)
"@path" is a UTF-8 text file relative to INPUT's directory; "@@" starts a text with a literal "@".
The prompt of a question is: DOCUMENT + "\\n\\nQuestion: " + QUESTION + "\\nAnswer:", the document and
the rest tokenized apart, so that every question of a document shares the document's tokens.

Per document, the first question runs alone and computes the document's prefix; its pages are
pinned while the other questions run batched together; the next document's prefix is
prefetched from cold meanwhile. With --url the job runs against `kvstore serve` instead
(OpenAI completions API, --concurrency requests at a time; a line's tenant is sent as the
X-Tenant header, which that server honours only with server.trust_tenant_header=true).

Output: ANSWERS.jsonl (id, question_index, question, answer, token_ids, finish_reason) and
ANSWERS.stats.jsonl (TTFT, prompt tokens, tokens served from each tier, generated tokens,
seconds), both appended once per finished document, and ANSWERS.occupancy.jsonl (the pages
in each tier, sampled every --sample-interval seconds by the in-process engine). Run the same
command again after an interruption (Ctrl-C, SIGTERM, a crash): finished questions are
skipped, and the final ANSWERS.jsonl is the same as an uninterrupted run's (answers are greedy
by default; with a temperature they are seeded per question). The stats differ from run to
run: they are kept apart so that the answers do not.

Progress: on a terminal, a bar that says what the job does (loading the model, tokenizing,
prefilling or answering document k/N), redrawn every half second; elsewhere, a line per document.

Exit status: 0 done; 1 done, but bad lines were skipped or questions failed (they are listed
on stderr and in the report); 2 bad options, or --fail-fast stopped at a problem;
130 / 143 interrupted by SIGINT / SIGTERM (run again to resume).
"""


def add_parser(subparsers) -> None:
    """Register `job` (with its `run` sub-command) on the `kvstore` command's subparsers."""
    p = subparsers.add_parser("job", help="run a long-document QA job: many questions over the same documents, "
                                          "their prefixes cached",
                              description="Long-document QA jobs. `kvstore job run --help` for the options.")
    configure(p)


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(title="job commands", dest="job_command", metavar="COMMAND", required=True)
    r = sub.add_parser("run", help="run a job (resumable)", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("input", metavar="INPUT.jsonl", help="the documents and their questions")
    r.add_argument("--out", metavar="ANSWERS.jsonl", required=True, help="the answers (appended; resumable)")
    r.add_argument("--stats", metavar="FILE", help="the per-question stats (default: ANSWERS.stats.jsonl)")
    r.add_argument("--report", metavar="DIR", help="write report.md and PNG plots into DIR")
    target = r.add_argument_group("target (default: the in-process engine)")
    target.add_argument("--model", metavar="DIR_OR_PRESET",
                        help="the model: a Hugging Face directory or a preset (config key `model`, default tiny); "
                             "with --url, the tokenizer to use (default: the served model's, if it is a preset)")
    target.add_argument("--url", metavar="http://HOST:PORT", help="a running `kvstore serve` to send the questions to")
    target.add_argument("--concurrency", type=int, default=4, metavar="N",
                        help="with --url: requests in flight at a time (default 4)")
    target.add_argument("--no-prefetch", action="store_true",
                        help="do not prefetch the next document's prefix from cold while one runs")
    target.add_argument("--sample-interval", type=float, default=0.5, metavar="SECONDS",
                        help="in-process engine: seconds between two samples of the tier occupancy (default 0.5)")
    sampling = r.add_argument_group("sampling (an input line's own fields win)")
    sampling.add_argument("--max-tokens", type=int, default=64, metavar="N", help="tokens per answer (default 64)")
    sampling.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0: greedy (default)")
    sampling.add_argument("--seed", type=int, metavar="N",
                          help="sampling seed of every question (default: one derived from the id and question)")
    r.add_argument("--fail-fast", action="store_true",
                   help="stop at the first bad input line or failed question (exit 2) instead of skipping it")
    r.add_argument("--progress", choices=MODES, default="auto",
                   help="auto (default): a bar on a terminal, a line per document elsewhere; "
                        "bar, lines: either one anyway; none: only problems")
    add_config_options(r)
    r.set_defaults(func=run)


def _say(message: str) -> None:
    print(f"kvstore job: {message}", file=sys.stderr, flush=True)


def _served_model(url: str) -> str:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=30) as r:
            return json.load(r)["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise KVStoreError(f"--url {url}: cannot read /v1/models ({exc})") from None


def _check(args: argparse.Namespace) -> None:
    if args.max_tokens < 1:
        raise ConfigError("--max-tokens", args.max_tokens, "must be an integer >= 1")
    if not 0 <= args.temperature <= 100:
        raise ConfigError("--temperature", args.temperature, "must be a number in [0, 100]")
    if args.concurrency < 1:
        raise ConfigError("--concurrency", args.concurrency, "must be an integer >= 1")
    if not 0.01 <= args.sample_interval <= 3600:
        raise ConfigError("--sample-interval", args.sample_interval, "must be a number of seconds in [0.01, 3600]")
    if args.url and not args.url.startswith(("http://", "https://")):
        raise ConfigError("--url", args.url, "must be an http:// or https:// URL")


class _Signals:
    """SIGINT / SIGTERM set the runner's stop event once; a second one acts as usual."""

    def __init__(self):
        self.signum: int | None = None
        self.stop: threading.Event | None = None
        self._old: dict[int, object] = {}

    def install(self, stop: threading.Event) -> None:
        self.stop = stop
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        self.stop.set()
        self.restore()

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


def run(args: argparse.Namespace) -> int:
    _check(args)
    if args.model and not args.url:
        args.set = [*args.set, f"model={args.model}"]
    config = config_from_args(args)
    job = read_input(args.input)
    for bad in job.bad:
        _say(f"{args.input}:{bad.line}: bad line, skipped: {bad.message}")
        if args.fail_fast:
            _say("stopped at the first bad line (--fail-fast); nothing was run")
            return 2
    log = AnswerLog(args.out, args.stats).open()
    if log.dropped_partial:
        _say(f"{args.out}: cut off a partly written last line ({log.dropped_partial} bytes); it is recomputed")
    order = [k for d in job.documents for k in d.keys()]
    todo = [k for k in order if not log.done(k)]
    todo_docs = len({k[0] for k in todo})
    session = log.sessions() + 1
    if order and not todo:
        _say(f"every question of {args.input} is answered already in {args.out}")
    elif len(todo) < len(order):
        _say(f"resuming: {len(order) - len(todo)} of {len(order)} answers are in {args.out}; "
             f"{len(todo)} to go")
    problems = {"failed": False}
    runner, flushed = None, [0]      # flushed: how many of the runner's occupancy samples are written

    def write_samples() -> None:
        samples = runner.outcome.samples
        n = len(samples)
        log.write_samples(samples[flushed[0]:n])
        flushed[0] = n

    def on_document(doc, results) -> None:
        write_samples()      # first: a run that wrote answers has its samples, even if killed next
        log.write([r.answer for r in results], [r.stats for r in results])
        if args.fail_fast and runner.outcome.failed:
            problems["failed"] = True
            runner.stop.set()

    signals, llm = _Signals(), None
    outcome = None
    progress = Progress(len(todo), todo_docs, args.progress if todo else "none")
    try:
        if todo:
            # the engine (and torch) load with the progress already on screen
            progress.phase("loading the engine")
            try:
                from app.job.engine_runner import EngineRunner
                from app.job.http_runner import HttpRunner
                from app.job.runner import Settings
            except ImportError as exc:
                raise KVStoreError(f"the job needs the engine, which cannot be imported ({exc})") from None
            settings = Settings(args.max_tokens, args.temperature, args.seed)
            if args.url:
                from engine.tokenizer import load_tokenizer
                progress.phase("loading the tokenizer", announce=True)
                tokenizer = load_tokenizer(args.model or _served_model(args.url))
                make_runner = functools.partial(HttpRunner, args.url, tokenizer, settings, on_document, progress,
                                                session, concurrency=args.concurrency, page_size=config.page_size)
            else:
                from engine import LLM
                progress.phase(f"loading the model ({config.model})", announce=True)
                llm = LLM(config.model, config=config)
                make_runner = functools.partial(EngineRunner, llm, settings, on_document, progress, session,
                                                prefetch=not args.no_prefetch, sample_s=args.sample_interval)
            # full collections do not walk the startup heap (kvstore.heap); frozen before the runner's
            # clock starts, as the freeze's one collection takes a moment
            with frozen("kvstore job"):
                runner = make_runner()
                signals.install(runner.stop)
                outcome = runner.run(job.documents, log.done)
    finally:
        signals.restore()
        try:
            if runner is not None:
                write_samples()
            if llm is not None:
                progress.phase("closing the store")
                llm.close()      # hot and warm pages go to cold: a resumed or later job finds them
        finally:
            progress.close("done" if outcome is not None and not outcome.interrupted else "stopped")

    failed = [f"line {d.line}, document {d.id!r}, {why}" for d, why in (outcome.failed if outcome else [])]
    if signals.signum is not None:
        name = signal.Signals(signals.signum).name
        _say(f"interrupted by {name}: {len(log.answers)} of {len(order)} answers are in {args.out}; "
             "run the same command again to resume")
        return 128 + signals.signum
    log.finalize(order)
    if args.report:
        from app.job.report import ReportInput, write_report
        keys = set(order)
        records = [r for r in read_stats(log.stats_path) if (str(r["id"]), int(r["question_index"])) in keys]
        status = "complete" if all(log.done(k) for k in order) else "incomplete"
        path = write_report(ReportInput(records, read_stats(log.occupancy_path), [str(b) for b in job.bad], failed,
                                        {"input": args.input, "output": args.out, "stats": str(log.stats_path),
                                         "target": args.url or f"in-process engine, model {config.model}",
                                         "status": status}, order), args.report)
        _say(f"report: {path}")
    if problems["failed"]:
        _say("stopped at the first failed question (--fail-fast)")
        return 2
    if job.bad or failed:
        _say(f"done with problems: {len(job.bad)} bad line(s) skipped, {len(failed)} question(s) failed; "
             f"{len(log.answers)} of {len(order)} answers are in {args.out}")
        return 1
    _say(f"done: {len(order)} answers in {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`kvstore job` as a program of its own: `python -m app.job.cli run ...`."""
    from app.cli import main as kvstore_main

    return kvstore_main(["job", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
