"""A job's input (JSONL of documents and their questions) and its resumable output.

Input: one JSON object a line (blank lines are ignored):

    {"id": "report-7", "document": "the text..." | "@docs/report-7.txt",
     "questions": ["What is ...?", ...],
     "max_tokens": 64, "temperature": 0.0, "seed": 1, "tenant": "acme"}      # optional

`document` is the text itself, or, when it starts with "@", the path of a UTF-8 text file,
relative to the input file's directory (or absolute); "@@" starts a text with a literal "@".
A line that is not such an object is a BadLine, reported with its line number.

Output: two JSONL files, one line per (document id, question index) in each, and a third of
samples.

- ANSWERS.jsonl: {"id", "question_index", "question", "answer", "token_ids", "finish_reason"}:
  only what the model computed, so an interrupted and resumed job ends with the same bytes as
  an uninterrupted one.
- ANSWERS.stats.jsonl: the measurements (TTFT, tokens served from each tier, time...), which
  differ from run to run; the report is built from it.
- ANSWERS.occupancy.jsonl: the pages in each tier, sampled on a timer by the in-process runner,
  one line a sample ({"session", "seconds", "questions", "hot", "warm", "cold"}); "seconds" count
  from the start of its session (run), so that the report can put every run on one clock.

Both are appended and fsync'ed once per finished document (answers first). On start the
answers file is read back: a partly written last line is cut off, and the items it holds are
finished and skipped. When every item is done the answers are put in input order (an atomic
rewrite, needed only if an interruption left them out of order).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.errors import KVStoreError

Key = tuple[str, int]   # (document id, question index)
FIELDS = {"id", "document", "questions", "max_tokens", "temperature", "seed", "tenant"}
ANSWER_FIELDS = ("id", "question_index", "question", "answer", "token_ids", "finish_reason")


class OutputError(KVStoreError):
    """The output file cannot be resumed from (a complete line that is not an answer)."""


@dataclass
class BadLine:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


@dataclass
class Document:
    """One input line: a document and the questions asked about it."""

    line: int
    id: str
    document: str
    questions: list[str]
    base_dir: Path
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    tenant: str = ""

    @property
    def path(self) -> Path | None:
        if not self.document.startswith("@") or self.document.startswith("@@"):
            return None
        return self.base_dir / self.document[1:]

    def text(self) -> str:
        """The document's text (read from its file for "@path"). Raises KVStoreError."""
        path = self.path
        if path is None:
            return self.document[1:] if self.document.startswith("@@") else self.document
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KVStoreError(f"document {self.document!r}: cannot read it as UTF-8 text ({exc})") from None

    def keys(self) -> list[Key]:
        return [(self.id, q) for q in range(len(self.questions))]


@dataclass
class JobInput:
    documents: list[Document] = field(default_factory=list)
    bad: list[BadLine] = field(default_factory=list)

    @property
    def num_questions(self) -> int:
        return sum(len(d.questions) for d in self.documents)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_line(text: str, line: int, base_dir: Path) -> Document:
    """One input line to a Document; raises ValueError with the reason."""
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError("must be a JSON object with id, document and questions")
    unknown = sorted(set(obj) - FIELDS)
    if unknown:
        raise ValueError(f"unknown field {', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(FIELDS))}")
    doc_id = obj.get("id")
    if not (isinstance(doc_id, str) and doc_id) and not _is_int(doc_id):
        raise ValueError("id must be a non-empty string or an integer")
    document = obj.get("document")
    if not isinstance(document, str) or not document:
        raise ValueError("document must be a non-empty string (the text, or @PATH of a text file)")
    questions = obj.get("questions")
    if not isinstance(questions, list) or not questions or not all(isinstance(q, str) and q for q in questions):
        raise ValueError("questions must be a non-empty list of non-empty strings")
    max_tokens, temperature, seed = obj.get("max_tokens"), obj.get("temperature"), obj.get("seed")
    if max_tokens is not None and not (_is_int(max_tokens) and max_tokens >= 1):
        raise ValueError(f"max_tokens = {max_tokens!r}: must be an integer >= 1")
    if temperature is not None and not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
                                        and math.isfinite(temperature) and 0 <= temperature <= 100):
        raise ValueError(f"temperature = {temperature!r}: must be a number in [0, 100]")
    if seed is not None and not (_is_int(seed) and -2**63 <= seed < 2**63):
        raise ValueError(f"seed = {seed!r}: must be an integer in [-2^63, 2^63)")
    tenant = obj.get("tenant", "")
    if not isinstance(tenant, str):
        raise ValueError("tenant must be a string")
    doc = Document(line, str(doc_id), document, list(questions), base_dir, max_tokens,
                   float(temperature) if temperature is not None else None, seed, tenant)
    if doc.path is not None and not doc.path.is_file():
        raise ValueError(f"document {document!r}: no such file ({doc.path})")
    return doc


def read_input(path: str | Path) -> JobInput:
    """Every document of an input file, and its bad lines (with their line numbers)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise KVStoreError(f"cannot read the input {str(path)!r} ({exc.strerror})") from None
    job = JobInput()
    seen: dict[str, int] = {}
    for number, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            doc = parse_line(line.decode("utf-8"), number, path.parent)
        except UnicodeDecodeError:
            job.bad.append(BadLine(number, "not UTF-8 text"))
            continue
        except ValueError as exc:
            job.bad.append(BadLine(number, str(exc)))
            continue
        if doc.id in seen:
            job.bad.append(BadLine(number, f"id {doc.id!r} is used already on line {seen[doc.id]}"))
            continue
        seen[doc.id] = number
        job.documents.append(doc)
    return job


def _dumps(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(", ", ": "))


def stats_path_for(out: str | Path) -> Path:
    """ANSWERS.jsonl -> ANSWERS.stats.jsonl (next to it)."""
    out = Path(out)
    stem = out.name[:-len(".jsonl")] if out.name.endswith(".jsonl") else out.name
    return out.with_name(stem + ".stats.jsonl")


def occupancy_path_for(stats: str | Path) -> Path:
    """ANSWERS.stats.jsonl -> ANSWERS.occupancy.jsonl (next to it)."""
    stats = Path(stats)
    stem = stats.name
    for ending in (".jsonl", ".stats"):
        stem = stem[:-len(ending)] if stem.endswith(ending) else stem
    return stats.with_name(stem + ".occupancy.jsonl")


class AnswerLog:
    """The output files of a job: what is finished, and appending what finishes next."""

    def __init__(self, out: str | Path, stats: str | Path | None = None):
        self.path = Path(out)
        self.stats_path = Path(stats) if stats else stats_path_for(self.path)
        self.occupancy_path = occupancy_path_for(self.stats_path)
        self.answers: dict[Key, dict] = {}     # finished items, as read or written
        self.order: list[Key] = []             # their order in the file
        self.dropped_partial = 0               # bytes of a partly written last line cut off on open

    def open(self) -> "AnswerLog":
        """Read what a previous run finished; cut off a partly written last line of either file."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.dropped_partial = _cut_partial_line(self.path)
        _cut_partial_line(self.stats_path)
        _cut_partial_line(self.occupancy_path)
        if self.path.exists():
            with open(self.path, encoding="utf-8") as f:
                for number, line in enumerate(f, start=1):
                    try:
                        obj = json.loads(line)
                        key = (str(obj["id"]), int(obj["question_index"]))
                    except (ValueError, KeyError, TypeError):
                        raise OutputError(f"{self.path}: line {number} is not an answer of a job; "
                                          "pass another --out, or remove the file to start over") from None
                    if key not in self.answers:
                        self.order.append(key)
                    self.answers[key] = obj
        return self

    def done(self, key: Key) -> bool:
        return key in self.answers

    def sessions(self) -> int:
        """How many runs wrote stats or samples already (this run is sessions() + 1)."""
        return max((r.get("session", 0) for path in (self.stats_path, self.occupancy_path) for r in read_stats(path)),
                   default=0)

    def write(self, answers: list[dict], stats: list[dict]) -> None:
        """Append one document's finished items to both files, durably (answers first)."""
        if not answers:
            return
        _append(self.path, "".join(_dumps(a) + "\n" for a in answers))
        for a in answers:
            key = (str(a["id"]), int(a["question_index"]))
            self.order.append(key)
            self.answers[key] = a
        if stats:
            _append(self.stats_path, "".join(_dumps(s) + "\n" for s in stats))

    def write_samples(self, samples: list[dict]) -> None:
        """Append tier occupancy samples."""
        if samples:
            _append(self.occupancy_path, "".join(_dumps(s) + "\n" for s in samples))

    def finalize(self, order: list[Key]) -> bool:
        """Put the answers in `order` (input order) when every item of it is done; answers of items
        not in `order` go last, as they were. Returns whether the file was rewritten."""
        if not all(k in self.answers for k in order) or self.order[:len(order)] == order:
            return False
        wanted = set(order)
        keys = order + [k for k in self.order if k not in wanted]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(_dumps(self.answers[k]) + "\n" for k in keys))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        self.order = keys
        return True


def read_stats(path: str | Path) -> list[dict]:
    """The stats records (or occupancy samples) of a job: complete lines only."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.endswith("\n"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    return out


def _append(path: Path, text: str) -> None:
    new = not path.exists()
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    if new:
        _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _cut_partial_line(path: Path) -> int:
    """Truncate the file after its last newline; returns the bytes cut off."""
    if not path.exists():
        return 0
    size = path.stat().st_size
    with open(path, "rb+") as f:
        end, chunk = size, 1 << 16
        while end > 0:
            start = max(0, end - chunk)
            f.seek(start)
            block = f.read(end - start)
            i = block.rfind(b"\n")
            if i >= 0:
                keep = start + i + 1
                break
            end = start
        else:
            keep = 0
        if keep < size:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    return size - keep
