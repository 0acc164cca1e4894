"""The dashboard in headless Chromium: it loads with a token, shows the numbers of /v1/stats and
/v1/prefixes, draws the time series of /v1/history after real engine traffic, asks for the token
when it has none, and renders a non-blank screenshot."""

from __future__ import annotations

import asyncio
import os
import shutil
import struct
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest

from kvstore import __version__
from kvstore.server.admin import STATE
from storeutil import QUIET, fill_and_commit, make_store, stall_writes, tokens_for
from test_admin import TOKEN, running_admin
from test_history import sample_every

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
needs = (CHROMIUM is not None, "Chromium is not installed (scripts/bootstrap installs it)")
pytestmark = pytest.mark.usefixtures("requires_part")


async def chromium(tmp_path: Path, url: str, *args: str) -> str:
    """Run headless Chromium on `url` with a fresh profile until the page has refreshed (virtual time)."""
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", "--virtual-time-budget=5000", "--window-size=1280,900", "--hide-scrollbars",
        *args, url, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "HOME": str(tmp_path)})
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 90)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out.decode()


class Elements(HTMLParser):
    """id -> (attributes, text) of every element with an id, and the rows of the prefixes table."""

    def __init__(self, html: str):
        super().__init__()
        self.by_id: dict[str, tuple[dict, str]] = {}
        self.rows: list[dict] = []
        self._open: list[str | None] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "tr" and "data-key" in attrs:
            self.rows.append(attrs)
        if tag in ("input", "meta", "br", "img", "link"):
            return
        self._open.append(attrs.get("id"))
        if attrs.get("id"):
            self.by_id[attrs["id"]] = (attrs, "")

    def handle_endtag(self, tag):
        if tag not in ("input", "meta", "br", "img", "link") and self._open:
            self._open.pop()

    def handle_data(self, data):
        for open_id in self._open:
            if open_id:
                attrs, text = self.by_id[open_id]
                self.by_id[open_id] = (attrs, text + data)

    def value(self, id: str) -> str:
        return self.by_id[id][0]["data-value"]

    def text(self, id: str) -> str:
        return self.by_id[id][1].strip()


async def test_dashboard_shows_the_stats(tmp_path):
    async with running_admin(tmp_path, token=TOKEN) as admin:
        html = await chromium(tmp_path, f"{admin.url}/#token={TOKEN}", "--dump-dom")
        _, stats = await admin.get("/v1/stats")
        _, prefixes = await admin.get("/v1/prefixes?limit=20")
    page = Elements(html)
    status = page.by_id["status"][0]
    assert status["data-state"] == "ok" and int(status["data-refreshes"]) >= 2, page.text("status")
    for tier in ("hot", "warm", "cold"):
        t = stats["tiers"][tier]
        assert int(page.value(f"{tier}-used-bytes")) == t["used_bytes"]
        assert int(page.value(f"{tier}-capacity-bytes")) == t["capacity_bytes"]
        assert int(page.value(f"{tier}-pages")) == t["pages"] and page.text(f"{tier}-pages") == str(t["pages"])
        assert float(page.value(f"{tier}-occupancy")) == pytest.approx(t["used_bytes"] / t["capacity_bytes"])
        shown = page.value(f"{tier}-hit-rate")
        assert (shown == "") if t["hit_rate"] is None else float(shown) == pytest.approx(t["hit_rate"])
        hits_misses = page.by_id[f"{tier}-hits-misses"][0]
        assert (int(hits_misses["data-hits"]), int(hits_misses["data-misses"])) == (t["hits"], t["misses"])
        assert int(page.value(f"{tier}-evictions")) == t["evictions"]
    assert page.text("hot-used-bytes") == "32.00 KiB" and page.text("hot-occupancy") == "50.0 %"
    assert page.text("hot-hit-rate") == "100.0 %" and page.text("warm-hit-rate") == "–"
    assert int(page.value("entries")) == stats["entries"] == 7
    assert int(page.value("queue-depth")) == stats["queue_depth"]
    assert int(page.value("bytes-moved")) == sum(stats["bytes_moved"].values())
    check_write_behind(page, stats)
    assert page.text("wb-max-dirty-pages") == "4" and int(page.value("wb-written-pages")) == 7
    assert page.by_id["write-behind"][0]["data-level"] == "low"   # nothing dirty
    assert [r["data-key"] for r in page.rows] == [p["key"] for p in prefixes["prefixes"]] != []
    assert int(page.rows[0]["data-hits"]) == prefixes["prefixes"][0]["hits"]
    assert page.by_id["prefixes"][0]["data-count"] == str(len(prefixes["prefixes"]))
    assert {r["data-namespace"] for r in page.rows} == {p["namespace"] for p in prefixes["prefixes"]}
    assert page.by_id["tier-hot"][0]["data-level"] == "low"   # 50%, below the low watermark (75%)
    assert TOKEN not in html   # the token left the address (kept in localStorage only)


def check_write_behind(page: Elements, stats: dict) -> None:
    """The write-behind card and the drops by reason show /v1/stats (read after the page: the lag
    only grows)."""
    wb = stats["write_behind"]
    for field in ("dirty_pages", "max_dirty_pages", "written_pages", "stranded_pages", "backpressure_waits",
                  "refused_pages"):
        assert int(page.value("wb-" + field.replace("_", "-"))) == wb[field], field
    assert float(page.by_id["wb-backpressure-waits"][0]["data-wait-s"]) == pytest.approx(wb["backpressure_wait_s"])
    assert 0 <= float(page.value("wb-lag")) <= wb["lag_s"] and (float(page.value("wb-lag")) > 0) == (wb["lag_s"] > 0)
    for reason, n in stats["dropped_by_reason"].items():
        assert int(page.value("dropped-" + reason.replace("_", "-"))) == n, reason
    assert int(page.value("dropped-pages")) == stats["dropped_pages"] == sum(stats["dropped_by_reason"].values())


async def test_dashboard_shows_write_behind_and_drops(tmp_path):
    """A disk that stalls: the dirty pages at their bound (the card turns high), ageing, a producer
    refused; then a store without a cold tier, dropping what memory evicts."""
    store = make_store(tmp_path / "a", warm=8)
    gate = stall_writes(store, up_to_s=60)
    try:
        store.commit_warm(store.namespace(), tokens_for(1, 4), store.allocate_warm(4))
        assert store.allocate_warm(2, partial=True) == []   # waited for room, stored nothing
        async with running_admin(tmp_path, token=TOKEN, store=store) as admin:
            page = Elements(await chromium(tmp_path, f"{admin.url}/#token={TOKEN}", "--dump-dom"))
            _, stats = await admin.get("/v1/stats")
    finally:
        gate.set()
        store.close(persist=False)
    assert page.by_id["status"][0]["data-state"] == "ok", page.text("status")
    check_write_behind(page, stats)
    wb = stats["write_behind"]
    assert (wb["dirty_pages"], wb["max_dirty_pages"], wb["refused_pages"], wb["backpressure_waits"]) == (4, 4, 2, 1)
    assert float(page.value("wb-lag")) > 0.2 and page.text("wb-lag").split()[1] in ("ms", "s")
    assert page.text("wb-backpressure-waits").startswith("1 (")
    assert page.by_id["write-behind"][0]["data-level"] == "high"

    store = make_store(tmp_path / "b", hot=4, warm=4, **{**QUIET, "cold.enabled": "false"})
    try:
        for doc in range(6):   # 12 pages, room for 8
            slots, _ = fill_and_commit(store, store.namespace(), tokens_for(doc, 2))
            store.release(slots)
        async with running_admin(tmp_path, token=TOKEN, store=store) as admin:
            page = Elements(await chromium(tmp_path, f"{admin.url}/#token={TOKEN}", "--dump-dom"))
            _, stats = await admin.get("/v1/stats")
    finally:
        store.close(persist=False)
    check_write_behind(page, stats)
    assert int(page.value("dropped-no-cold-tier")) == stats["dropped_pages"] > 0
    assert page.text("wb-max-dirty-pages") == "– (no cold tier)" and page.text("wb-lag") == "0 s"
    assert page.by_id["write-behind"][0]["data-level"] == "low"


async def test_dashboard_asks_for_the_token(tmp_path):
    async with running_admin(tmp_path, token=TOKEN) as admin:
        page = Elements(await chromium(tmp_path, f"{admin.url}/", "--dump-dom"))
        assert page.by_id["status"][0]["data-state"] == "auth" and "token" in page.text("status")
        assert "data-value" not in page.by_id["hot-pages"][0] and page.text("hot-pages") == ""   # nothing shown
        page = Elements(await chromium(tmp_path, f"{admin.url}/#token=wrong", "--dump-dom"))
        assert page.by_id["status"][0]["data-state"] == "auth"


def png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit, non-interlaced PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, header
    bpp = 3 if color == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, rows


async def test_dashboard_screenshot(tmp_path):
    shot = tmp_path / "dashboard.png"
    async with running_admin(tmp_path, token=TOKEN) as admin:
        await chromium(tmp_path, f"{admin.url}/#token={TOKEN}", f"--screenshot={shot}")
    width, height, rows = png_pixels(shot.read_bytes())
    assert (width, height) == (1280, 900)
    bpp = len(rows[0]) // width
    colours = {row[x:x + 3] for row in rows[::4] for x in range(0, len(row), bpp * 4)}
    assert len(colours) > 20   # text, bars and cards, not a blank page
    below_low_watermark = bytes((0x40, 0xc0, 0x57))
    assert below_low_watermark in colours   # the hot tier's occupancy bar is drawn, green at 50%


async def test_dashboard_draws_the_history(tmp_path):
    from engine import LLM, AsyncLLM, SamplingParams
    from engine.config import load_config

    config = load_config(None, {}, {"data_dir": str(tmp_path / "llm"), "hot.device": "cpu", "hot.pool": "8MiB",
                                    "warm.bytes": "8MiB"})
    llm = LLM("tiny", config=config)
    engine = AsyncLLM(llm)
    await engine.start()
    shot = tmp_path / "history.png"
    try:
        async with running_admin(tmp_path, token=TOKEN, engine=engine, store=llm.store) as admin:
            metrics = admin.app[STATE].metrics
            engine.on_finish = lambda o: metrics.observe_request(   # as `kvstore serve` feeds it
                o.ttft_s, o.latency_s, o.finish_reason in ("stop", "length"), prompt_tokens=len(o.prompt_token_ids),
                generation_tokens=len(o.token_ids), cached_tokens=o.cached_tokens)
            await sample_every(admin.app, 0.2)
            cached = []
            for _ in range(3):   # the same prompt: the second and third find it in hot
                async for out in engine.generate(list(range(1, 120)), SamplingParams(max_tokens=4, temperature=0)):
                    pass
                cached.append(out.cached_tokens["hot"])
            assert cached[0] == 0 and cached[1] > 0
            for _ in range(100):   # a sample after the traffic, and a quiet one after it
                _, history = await admin.get("/v1/history")
                rates = [s["requests_per_s"] for s in history["samples"]]
                if any(rates) and rates[-1] == 0:
                    break
                await asyncio.sleep(0.1)
            assert len(history["samples"]) >= 2
            html = await chromium(tmp_path, f"{admin.url}/#token={TOKEN}", "--dump-dom")
            await chromium(tmp_path, f"{admin.url}/#token={TOKEN}", f"--screenshot={shot}")
            _, history = await admin.get("/v1/history")
            _, stats = await admin.get("/v1/stats")
    finally:
        await engine.stop()
        llm.close()
    page = Elements(html)
    assert page.by_id["status"][0]["data-state"] == "ok", page.text("status")
    assert page.text("server-model") == "tiny" and page.text("server-version") == __version__
    assert float(page.value("server-uptime")) > 0 and page.text("server-instance")

    # each chart drew the samples the server had when the page last refreshed
    last_t = float(page.by_id["chart-requests"][0]["data-last-t"])
    drawn = [s for s in history["samples"] if s["t"] <= last_t]
    assert drawn and drawn[-1]["t"] == last_t
    charts = {"occupancy": {t: lambda s, t=t: s["occupancy"][t] for t in ("hot", "warm", "cold")},
              "hit-rate": {t: lambda s, t=t: s["hit_rate"][t] for t in ("hot", "warm", "cold", "peer")},
              "requests": {"requests": lambda s: s["requests_per_s"]},
              "ttft": {"p50": lambda s: s["ttft_p50_s"], "p99": lambda s: s["ttft_p99_s"]},
              "bytes-moved": {d: lambda s, d=d: s["bytes_moved_per_s"][d] for d in ("up", "down")},
              "queue": {"waiting": lambda s: s["queue_depth"], "running": lambda s: s["running"]}}
    for chart, series in charts.items():
        assert page.by_id[f"chart-{chart}"][0]["data-points"] == str(len(drawn)), chart
        for name, value in series.items():
            values = [v for v in map(value, drawn) if v is not None]
            path = page.by_id[f"chart-{chart}-{name}"][0]
            assert int(path["data-points"]) == len(values), (chart, name)
            if values:
                assert float(path["data-last"]) == pytest.approx(values[-1]), (chart, name)
            else:
                assert path["data-last"] == "", (chart, name)
            assert page.value(f"legend-{chart}-{name}") == path["data-last"]
    assert float(page.by_id["chart-hit-rate-hot"][0]["data-last"]) > 0   # the repeated prompt's hits
    assert int(page.by_id["chart-requests-requests"][0]["data-points"]) == len(drawn) >= 2
    assert max(float(s["ttft_p99_s"] or 0) for s in drawn) > 0

    # occupancy is coloured by the tier's watermarks
    for tier in ("hot", "warm", "cold"):
        t = stats["tiers"][tier]
        occ = t["used_bytes"] / t["capacity_bytes"]
        level = "high" if occ >= t["high_watermark"] else "mid" if occ >= t["low_watermark"] else "low"
        assert page.by_id[f"tier-{tier}"][0]["data-level"] == level, tier

    width, height, rows = png_pixels(shot.read_bytes())
    bpp = len(rows[0]) // width
    colours = {row[x:x + 3] for row in rows[::2] for x in range(0, len(row), bpp)}
    assert bytes((0x9c, 0x36, 0xb5)) in colours   # the hot series' colour
