"""`kvstore inspect`: the admin API's client, against a live admin server on loopback."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys

import pytest

from conftest import REPO, clean_env
from kvstore.cli import main as kvstore_main
from kvstore.pages.keys import page_keys
from storeutil import QUIET, SPEC, fill_and_commit, make_store, stall_writes, tokens_for

sys.path.insert(0, str(REPO / "tests" / "server"))
from test_admin import TOKEN, running_admin  # noqa: E402

PS = SPEC.page_size


def inspect_main(argv: list[str]) -> int:
    return kvstore_main(["inspect", *argv])


@pytest.fixture
async def admin(tmp_path):
    async with running_admin(tmp_path, token=TOKEN) as a:
        yield a


async def cli(capsys, admin, *args: str, token: str | None = TOKEN) -> tuple[int, str, str]:
    """Run `kvstore inspect --url URL [--token T] ARGS` in a thread (the server runs on this loop)."""
    capsys.readouterr()
    argv = ["--url", admin.url, *(["--token", token] if token else []), *args]
    code = await asyncio.to_thread(inspect_main, argv)
    out, err = capsys.readouterr()
    return code, out, err


def rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.strip()]


async def test_stats(admin, capsys):
    code, out, err = await cli(capsys, admin, "stats")
    assert code == 0 and err == ""
    table = rows(out)
    assert table[0][:4] == ["TIER", "USED", "CAPACITY", "USE"]
    hot = next(r for r in table if r[0] == "hot")
    assert hot[1:3] == ["32.00", "KiB"] and hot[5:7] == ["50.0%", "4"]
    assert "7 pages indexed" in out and "queue: 0 waiting, 0 running" in out
    assert ("write-behind: 0 of 4 dirty pages, lag 0.0s, 7 written, 0 stranded; producer waits 0 (0.0s), "
            "refused pages 0\n") in out
    assert out.endswith("dropped pages: 0 (no_cold_tier 0, cold_full 0, write_error 0)\n")
    code, out, _ = await cli(capsys, admin, "--json", "stats")
    got = json.loads(out)
    _, direct = await admin.get("/v1/stats")
    got.pop("uptime_s"), direct.pop("uptime_s")
    assert code == 0 and got == direct


async def test_stats_write_behind_and_drops(tmp_path, capsys):
    """A disk that stalls (dirty pages at their bound, a producer refused), then a store without a
    cold tier dropping what memory evicts."""
    store = make_store(tmp_path / "a", warm=8)
    gate = stall_writes(store)
    try:
        store.commit_warm(store.namespace(), tokens_for(1, 4), store.allocate_warm(4))
        assert store.allocate_warm(2, partial=True) == []   # waited 0.2 s, stored nothing
        async with running_admin(tmp_path, token=TOKEN, store=store) as admin:
            code, out, _ = await cli(capsys, admin, "stats")
    finally:
        gate.set()
        store.close(persist=False)
    line = next(x for x in out.splitlines() if x.startswith("write-behind:"))
    assert code == 0 and re.fullmatch(r"write-behind: 4 of 4 dirty pages, lag \d+\.\ds, 0 written, 0 stranded; "
                                      r"producer waits 1 \(0\.[2-9]s\), refused pages 2", line), line
    assert "dropped pages: 0 (no_cold_tier 0, cold_full 0, write_error 0)" in out

    store = make_store(tmp_path / "b", hot=4, warm=4, **{**QUIET, "cold.enabled": "false"})
    try:
        for doc in range(6):   # 12 pages, room for 8
            slots, _ = fill_and_commit(store, store.namespace(), tokens_for(doc, 2))
            store.release(slots)
        dropped = store.stats()["dropped_pages"]
        async with running_admin(tmp_path, token=TOKEN, store=store) as admin:
            code, out, _ = await cli(capsys, admin, "stats")
    finally:
        store.close(persist=False)
    assert code == 0 and dropped > 0 and "write-behind: off (no cold tier)\n" in out
    assert f"dropped pages: {dropped} (no_cold_tier {dropped}, cold_full 0, write_error 0)" in out


async def test_pages(admin, capsys):
    code, out, _ = await cli(capsys, admin, "pages", "--tier", "hot")
    assert code == 0
    table = rows(out)
    assert table[0] == ["KEY", "TIERS", "DEPTH", "REFS", "PINNED", "HITS", "NAMESPACE"]
    assert len(table) == 1 + 4 + 1 and all(r[1] == "hot,cold" for r in table[1:5]) and "4 of 4 pages" in out
    code, out, _ = await cli(capsys, admin, "pages", "--limit", "2")
    assert "2 of 7 pages; more with --cursor" in out
    cursor = out.split("--cursor ")[1].strip()
    code, out, _ = await cli(capsys, admin, "pages", "--limit", "2", "--cursor", cursor)
    assert code == 0 and "2 of 7 pages" in out
    code, out, _ = await cli(capsys, admin, "--json", "pages", "--limit", "2", "--all")
    got = json.loads(out)
    assert len(got["pages"]) == 7 and got["next_cursor"] is None
    assert {p["key"] for p in got["pages"]} == {k.hex() for k in admin.store.index.entries}
    code, out, _ = await cli(capsys, admin, "pages", "--pinned")
    assert "0 of 0 pages" in out


async def test_page(admin, capsys):
    key = page_keys(admin.store.namespace(), tokens_for(1, 4), PS)[0].hex()
    code, out, _ = await cli(capsys, admin, "page", key)
    assert code == 0 and f"key        {key}" in out and "tiers      hot" in out
    code, out, err = await cli(capsys, admin, "page", "ab" * 32)
    assert code == 1 and out == "" and err.strip() == "kvstore inspect: no page with this key (HTTP 404)"
    code, out, err = await cli(capsys, admin, "page", "not-a-key")
    assert code == 2 and err.startswith("kvstore: error: key") and err.endswith(" (HTTP 400)\n")   # the server's words
    assert len(err.splitlines()) == 1


async def test_prefixes(admin, capsys):
    code, out, _ = await cli(capsys, admin, "prefixes")
    table = rows(out)
    assert code == 0 and table[0][:4] == ["LAST", "PAGE", "TOKENS", "PAGES"]
    assert table[1][1:] == [str(4 * PS), "4", "1", "4", "0", "0", "yes"]
    code, out, _ = await cli(capsys, admin, "--json", "prefixes", "--limit", "1")
    assert len(json.loads(out)["prefixes"]) == 1


async def test_lookup(admin, capsys):
    ids = ",".join(map(str, tokens_for(1, 4) + [3] * 10))
    code, out, _ = await cli(capsys, admin, "lookup", "--tokens", ids)
    assert code == 0
    assert out.strip() == f"prompt {4 * PS + 10} tokens; cached prefix {4 * PS} tokens (86.5%): hot 64, warm 0, cold 0"
    code, out, _ = await cli(capsys, admin, "--json", "lookup", "--tokens", ids, "--tenant", "other")
    assert json.loads(out)["cached_prefix_tokens"] == 0
    code, _, err = await cli(capsys, admin, "lookup", "--text", "hello")
    assert code == 2 and "text lookup needs a model" in err and len(err.splitlines()) == 1
    code, _, err = await cli(capsys, admin, "lookup", "--tokens", "1,x")
    assert code == 2 and "--tokens" in err


async def test_pin_unpin_evict_flush(admin, capsys, tmp_path):
    keys = [k.hex() for k in page_keys(admin.store.namespace(), tokens_for(1, 4), PS)]
    code, out, _ = await cli(capsys, admin, "pin", keys[0], keys[1], "--ttl", "60")
    assert code == 0 and out.strip() == "pinned 2 of 2 pages"
    assert (await admin.get("/v1/pages?pinned=true"))[1]["total"] == 2
    code, out, _ = await cli(capsys, admin, "pin", "--tokens", ",".join(map(str, tokens_for(1, 4))))
    assert out.strip() == "pinned 4 of 4 pages"
    code, out, _ = await cli(capsys, admin, "unpin", *keys)
    assert out.strip() == "unpinned 4 of 4 pages"
    ids = tmp_path / "prompt.json"
    ids.write_text(json.dumps(tokens_for(1, 4)))
    code, out, _ = await cli(capsys, admin, "evict", "--tokens", f"@{ids}", "--to", "warm")
    assert code == 0 and out.strip() == "moved 4 page copies down to warm (4 pages named)"
    assert (await admin.get("/v1/stats"))[1]["tiers"]["hot"]["pages"] == 0
    code, out, _ = await cli(capsys, admin, "--json", "flush", "warm")
    assert json.loads(out) == {"tier": "warm", "moved": 5}
    code, out, _ = await cli(capsys, admin, "evict", keys[3], "--to", "out")
    assert out.strip() == "moved 1 page copies out of the store (1 pages named)"
    assert (await admin.get(f"/v1/pages/{keys[3]}"))[0] == 404
    code, _, err = await cli(capsys, admin, "pin")
    assert code == 2 and "KEYs or --tokens" in err


async def test_errors_are_one_line(admin, capsys):
    code, out, err = await cli(capsys, admin, "stats", token="wrong")
    assert code == 2 and out == "" and err.strip().startswith("kvstore: error: missing or wrong bearer token")
    assert err.strip().endswith("(HTTP 401)") and len(err.splitlines()) == 1
    code, _, err = await cli(capsys, admin, "stats", token=None)
    assert code == 2 and "(HTTP 401)" in err
    with socket.socket() as s:   # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    capsys.readouterr()
    code = await asyncio.to_thread(inspect_main, ["--url", f"http://127.0.0.1:{port}", "stats"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert err.startswith(f"kvstore: error: cannot reach the admin API at http://127.0.0.1:{port}: ")


async def test_url_and_token_from_the_config(admin, capsys, monkeypatch):
    monkeypatch.setenv("KVSTORE_ADMIN_TOKEN", TOKEN)
    port = admin.runner.addresses[0][1]
    capsys.readouterr()
    code = await asyncio.to_thread(inspect_main, ["--set", f"admin.port={port}", "--json", "stats"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["entries"] == 7


# every action, with arguments of its own
ACTIONS = {
    "stats": [], "pages": ["--tier", "hot", "--pinned", "--limit", "5", "--all"], "page": ["ab" * 32],
    "prefixes": ["--limit", "3"], "lookup": ["--tokens", "1,2,3", "--tenant", "acme"], "pin": ["ab" * 32, "--ttl", "5"],
    "unpin": ["--tokens", "1,2"], "evict": ["ab" * 32, "--to", "cold"], "flush": ["warm"], "peers": [],
    "forget": ["instance-1"],
}
OPTIONS = ["--url", "http://127.0.0.1:1", "--token", "t0k", "--cacert", "ca.pem", "--timeout", "3", "--json",
           "--config", "kv.yaml", "--set", "page_size=32", "--data-dir", "data"]


def test_the_table_names_every_action():
    from kvstore.cli import build_parser, chosen_parser

    parser = chosen_parser(build_parser(), build_parser().parse_args(["inspect", "stats"]))
    assert parser.prog == "kvstore inspect stats"
    inspect_parser = build_parser()._subparsers._group_actions[0].choices["inspect"]
    assert set(inspect_parser._subparsers._group_actions[0].choices) == set(ACTIONS)


@pytest.mark.parametrize("action", ACTIONS)
def test_options_before_or_after_the_action(action):
    from kvstore.cli import build_parser

    parser = build_parser()
    before = vars(parser.parse_args(["inspect", *OPTIONS, action, *ACTIONS[action]]))
    after = vars(parser.parse_args(["inspect", action, *ACTIONS[action], *OPTIONS]))
    assert before == after
    assert (after["url"], after["token"], after["cacert"], after["timeout"], after["json"], after["config"],
            after["set"], after["data_dir"]) == ("http://127.0.0.1:1", "t0k", "ca.pem", 3.0, True, "kv.yaml",
                                                 ["page_size=32"], "data")
    split = vars(parser.parse_args(["inspect", *OPTIONS[:8], action, *ACTIONS[action], *OPTIONS[8:]]))
    assert split == after
    both = parser.parse_args(["inspect", "--set", "a=1", action, *ACTIONS[action], "--set", "b=2"])
    assert both.set == ["a=1", "b=2"]
    plain = parser.parse_args(["inspect", action, *ACTIONS[action]])
    assert (plain.url, plain.token, plain.timeout, plain.json, plain.set) == (None, None, 10.0, False, [])


async def test_options_after_the_action_against_a_server(admin, capsys):
    capsys.readouterr()
    argv = ["stats", "--json", "--url", admin.url, "--token", TOKEN]
    code = await asyncio.to_thread(inspect_main, argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["entries"] == 7
    key = page_keys(admin.store.namespace(), tokens_for(1, 4), PS)[0].hex()
    for action in (["pin", key], ["unpin", key], ["evict", key, "--to", "warm"], ["flush", "cold"]):
        code = await asyncio.to_thread(inspect_main, [*action, "--url", admin.url, "--json", "--token", TOKEN])
        out, err = capsys.readouterr()
        assert code == 0 and err == "", (action, err)
        assert isinstance(json.loads(out), dict), action
    code = await asyncio.to_thread(inspect_main, ["stats", "--url", admin.url, "--token", "wrong"])
    assert code == 2 and "(HTTP 401)" in capsys.readouterr().err


async def test_as_a_process(admin):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvstore", "inspect", "--url", admin.url, "prefixes", stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env=clean_env(KVSTORE_ADMIN_TOKEN=TOKEN), cwd=REPO)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert out.decode().startswith("LAST PAGE")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvstore", "inspect", "--url", admin.url, "prefixes", stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env=clean_env(), cwd=REPO)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and b"HTTP 401" in err


async def test_stats_show_the_remote_tier(tmp_path, capsys):
    """A store whose remote tier is down (nothing listens on its port): inspect stats says so, and
    /v1/stats validates against the OpenAPI document with tiers.remote in it (running_admin checks)."""
    store = make_store(tmp_path / "a", **{"remote.url": "redis://:pw@127.0.0.1:1/0", "remote.timeout_ms": "100"})
    try:
        store.fetch_remote(tokens_for(1, 2), store.namespace())
        async with running_admin(tmp_path, token=TOKEN, store=store) as admin:
            code, out, _ = await cli(capsys, admin, "stats")
            status, ready = await admin.get("/readyz")
            _, stats = await admin.get("/v1/stats")
    finally:
        store.close(persist=False)
    line = next(x for x in out.splitlines() if x.startswith("remote "))
    assert code == 0 and line.startswith("remote redis://:<redacted>@127.0.0.1:1/0: down (") and "pw" not in out
    assert status == 200 and ready["remote"]["state"] == "down"
    assert stats["tiers"]["remote"]["state"] == "down" and stats["tiers"]["remote"]["errors"] >= 1
