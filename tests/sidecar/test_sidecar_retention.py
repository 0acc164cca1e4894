"""What a `kvstore sidecar` acknowledges, it keeps: put storms into a 1 MiB warm tier with room on disk
(one client, then four at once) read back byte for byte with nothing dropped; SIGTERM under load
loses no acknowledged page, twenty times over; and with a disk slower than the puts, producers are
slowed down and told what was not stored, and nothing is dropped silently."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from kvstore.sidecar.client import NotStored, SidecarClient, SidecarError
from test_sidecar import MODEL, SPEC, pages_for, spawn, sock_dir, tokens_for   # noqa: F401 (fixtures)

PAGES = 8                                   # pages a document, a put each
STORM = {"hot.pool": "1MiB", "warm.bytes": "1MiB", "cold.max_bytes": "256MiB"}
SLOW_DISK = (str(Path(__file__).with_name("slow_disk.py")),)


def put_docs(path: Path, docs: range, acked: list, refused: list, errors: list) -> None:
    """One client putting doc after doc; records what was acknowledged, and what NotStored named.
    (Documents must differ modulo 500: tokens_for repeats with that period.)"""
    try:
        with SidecarClient(path, SPEC, MODEL) as kv:
            for doc in docs:
                try:
                    kv.put(tokens_for(doc, PAGES), pages_for(doc, PAGES))
                    acked.append((doc, PAGES))
                except NotStored as exc:
                    acked.append((doc, exc.start_page))
                    refused.append((doc, exc.start_page, exc.pages))
    except SidecarError as exc:
        errors.append(exc)


def storm(path: Path, clients: list[range]) -> tuple[list, list]:
    acked: list = []
    refused: list = []
    errors: list = []
    threads = [threading.Thread(target=put_docs, args=(path, docs, acked, refused, errors)) for docs in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return acked, refused


def read_back(kv: SidecarClient, acked: list) -> list:
    """The acknowledged pages that do not come back byte for byte: (doc, pages expected, pages got)."""
    bad = []
    for doc, stored in acked:
        got = kv.get(tokens_for(doc, PAGES))
        if len(got) < stored or not torch.equal(got[:stored], pages_for(doc, PAGES)[:stored]):
            bad.append((doc, stored, len(got)))
    return bad


def test_a_put_storm_keeps_every_acknowledged_page(spawn):
    sc = spawn(**STORM)
    acked, refused = storm(sc.socket, [range(0, 40)])              # one client, 320 pages
    assert len(acked) == 40 and not refused
    more, refused = storm(sc.socket, [range(40 + 100 * i, 140 + 100 * i) for i in range(4)])
    assert len(more) == 400 and not refused                          # four at once, 800 pages each
    with sc.client() as kv:
        assert read_back(kv, acked + more) == []
        st = kv.stats()
    assert st["dropped_pages"] == 0 and st["write_behind"]["refused_pages"] == 0, st["dropped_by_reason"]
    assert st["tiers"]["cold"]["pages"] == 3520
    assert sc.stop() == 0
    assert "Traceback" not in sc.log_path.read_text()


def _writer(path: Path, use_shm: bool, docs: range, acked: list, errors: list):
    """Put doc after doc until the sidecar goes away; record the docs whose put was acknowledged."""
    try:
        kv = SidecarClient(path, SPEC, MODEL, use_shm=use_shm)
    except SidecarError as exc:
        errors.append(exc)
        return
    try:
        for doc in docs:
            kv.put(tokens_for(doc, 4), pages_for(doc, 4))
            acked.append(doc)
            time.sleep(0.005)
    except SidecarError:
        pass   # the sidecar is draining or gone
    finally:
        kv.close()


@pytest.mark.parametrize("run", range(20))
def test_sigterm_under_load_loses_no_acknowledged_page(spawn, run):
    sc = spawn()
    acked: list[int] = []
    errors: list = []
    threads = [threading.Thread(target=_writer, args=(sc.socket, use_shm, range(100 + 100 * i, 180 + 100 * i),
                                                      acked, errors))
               for i, use_shm in enumerate((True, True, False))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while len(acked) < 30 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sc.stop() == 0   # while the writers are putting
    for t in threads:
        t.join(30)
    assert not errors and 30 <= len(acked) < 240, (len(acked), errors)
    assert not sc.socket.exists()
    log = sc.log_path.read_text()
    assert "draining" in log and "Traceback" not in log

    sc = spawn()   # the same data dir
    with sc.client() as kv:
        lost = [doc for doc in acked if not torch.equal(kv.get(tokens_for(doc, 4)), pages_for(doc, 4))]
        assert not lost, f"{len(lost)} of {len(acked)} acknowledged documents lost: {lost[:10]}"
        assert kv.stats()["tiers"]["cold"]["pages"] >= 4 * len(acked)
    assert sc.stop() == 0


def test_puts_faster_than_the_disk_wait_and_are_told_what_was_not_stored(spawn):
    """Every cold transaction takes 0.5 s: the write-behind queue reaches its bound (half the warm
    tier), puts wait for it (daemon.backpressure_timeout_s), and past that the put stores the pages
    that fit and raises NotStored naming the rest. Nothing acknowledged is lost or dropped."""
    sc = spawn(command=SLOW_DISK, env={"SLOW_DISK_COMMIT_DELAY_S": "0.5"},
               **{**STORM, "cold.backend": "slow-lmdb", "daemon.backpressure_timeout_s": "0.2"})
    started = time.monotonic()
    acked, refused = storm(sc.socket, [range(i * 100, i * 100 + 60) for i in range(2)])
    took = time.monotonic() - started
    assert refused, "no put was refused: the disk was not slower than the puts"
    with sc.client() as kv:
        st = kv.stats()
        for doc, start, pages in refused:   # exactly the pages it named are missing, those before it are there
            assert kv.lookup(tokens_for(doc, PAGES)).pages == start and start + pages == PAGES
        assert read_back(kv, acked) == []
        st = kv.stats()
    wb = st["write_behind"]
    assert wb["backpressure_waits"] > 0 and wb["backpressure_wait_s"] > 0.2      # producers slowed down
    assert wb["refused_pages"] == sum(pages for _, _, pages in refused)        # counted as it was told
    assert st["dropped_pages"] == 0 and took > 1.0
    assert sc.stop() == 0
    assert "Traceback" not in sc.log_path.read_text()
