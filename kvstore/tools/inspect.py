"""`kvstore inspect`: a client of a running store's REST admin API.

    kvstore inspect stats                         per tier: use, pages, hit rate, evictions...; write-behind
    kvstore inspect pages --tier hot --limit 20   cached pages (paginated: --cursor, or --all)
    kvstore inspect page KEY                      one page
    kvstore inspect prefixes                      the most reused prefixes
    kvstore inspect lookup --tokens 1,2,3         how much of a prompt is cached (--text needs a model)
    kvstore inspect pin KEY... | --tokens IDS     keep pages (a prefix) in place (--ttl S)
    kvstore inspect unpin KEY... | --tokens IDS
    kvstore inspect evict KEY... | --tokens IDS --to warm|cold|out
    kvstore inspect flush hot|warm|cold

The server is --url (default: from the config, admin.host and admin.port); the bearer token is
--token, else admin.token (KVSTORE_ADMIN_TOKEN). Human tables by default, the API's JSON with
--json. Exit codes: 0 done, 1 not found or refused by the store, 2 any other error (the server
cannot be reached, a wrong token, bad input), as one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import re
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from kvstore.config import format_size
from kvstore.errors import KVStoreError

TIERS = ("hot", "warm", "cold")


class RequestFailed(KVStoreError):
    """The server answered with an error status."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{message} (HTTP {status})")
        self.status = status


class AdminClient:
    """A small synchronous client of the admin API (urllib: no dependency)."""

    def __init__(self, url: str, token: str = "", timeout: float = 10.0, cafile: str | None = None):
        self.url = url.rstrip("/")
        self.token, self.timeout = token, timeout
        self.context = ssl.create_default_context(cafile=cafile) if self.url.startswith("https:") else None

    def request(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout, context=self.context) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read())["error"]
            except (ValueError, KeyError, TypeError):
                message = exc.reason
            raise RequestFailed(exc.code, str(message)) from None
        except urllib.error.URLError as exc:
            reason = getattr(exc.reason, "strerror", None) or exc.reason
            raise KVStoreError(f"cannot reach the admin API at {self.url}: {reason}") from None
        except (OSError, ValueError) as exc:   # timeouts, resets, a non-JSON answer
            raise KVStoreError(f"admin API at {self.url}: {exc}") from None

    def get(self, path: str, **query) -> dict:
        query = {k: v for k, v in query.items() if v is not None}
        return self.request("GET", path + (f"?{urllib.parse.urlencode(query)}" if query else ""))

    def post(self, path: str, body: dict) -> dict:
        return self.request("POST", path, body)


# arguments
def parse_tokens(text: str) -> list[int]:
    """Token ids: '1,2,3', '1 2 3', a JSON list, or @FILE holding any of those."""
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            raise KVStoreError(f"--tokens {text}: cannot read the file ({exc.strerror})") from None
    items = re.split(r"[\s,\[\]]+", text.strip())
    try:
        return [int(t) for t in items if t]
    except ValueError:
        raise KVStoreError("--tokens: must be token ids separated by commas or spaces (or @FILE)") from None


def _target(args: argparse.Namespace) -> dict:
    if bool(args.keys) == (args.tokens is not None):
        raise KVStoreError(f"inspect {args.action}: give page KEYs or --tokens (a prefix), not both or neither")
    if args.keys:
        return {"keys": args.keys}
    body = {"tokens": parse_tokens(args.tokens)}
    if args.tenant:
        body["tenant"] = args.tenant
    return body


def _default_url(config) -> str:
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(config.admin.host, config.admin.host)
    scheme = "https" if config.admin.tls_cert else "http"
    return f"{scheme}://[{host}]:{config.admin.port}" if ":" in host else f"{scheme}://{host}:{config.admin.port}"


def client_from_args(args: argparse.Namespace) -> AdminClient:
    from kvstore.config import config_from_args

    config = config_from_args(args)
    cafile = args.cacert or config.admin.tls_cert or None
    return AdminClient(args.url or _default_url(config), args.token or config.admin.token, args.timeout, cafile)


# tables
def table(rows: list[list], header: list[str], right: set[int] = frozenset()) -> str:
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in
                               enumerate(zip(r, widths))).rstrip() for r in cells)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def show_stats(s: dict) -> str:
    rows = []
    for name in TIERS:
        t = s["tiers"][name]
        use = t["used_bytes"] / t["capacity_bytes"] if t["capacity_bytes"] else None
        rows.append([name, format_size(t["used_bytes"]), format_size(t["capacity_bytes"]), _pct(use), t["pages"],
                     t["pinned_pages"], _pct(t["hit_rate"]), t["hits"], t["misses"], t["evictions"], t["promotions"]])
    out = table(rows, ["TIER", "USED", "CAPACITY", "USE", "PAGES", "PINNED", "HIT RATE", "HITS", "MISSES",
                       "EVICTIONS", "PROMOTIONS"], right=set(range(1, 11)))
    moved = ", ".join(f"{d} {format_size(n)}" for d, n in s["bytes_moved"].items() if n) or "nothing yet"
    dropped = ", ".join(f"{reason} {n}" for reason, n in s["dropped_by_reason"].items())
    return (f"{out}\n\n{s['entries']} pages indexed, {format_size(s['page_bytes'])} each ({s['spec']})\n"
            f"policy {s['eviction_policy']}, {s['write_policy']}; queue: {s['queue_depth']} waiting, "
            f"{s['running']} running; corrupt pages {s['corrupt_pages']}\nbytes moved: {moved}\n"
            f"{show_write_behind(s['write_behind'])}\ndropped pages: {s['dropped_pages']} ({dropped})"
            + (f"\n{show_remote(s['tiers']['remote'])}" if "remote" in s["tiers"] else ""))


def show_remote(r: dict) -> str:
    state = r["state"] + (f" ({r['last_error']})" if r["last_error"] else "")
    return (f"remote {r['url']}: {state}; {r['hits']} hits, {r['misses']} misses, {r['corrupt_pages']} corrupt, "
            f"{r['errors']} errors, read {r['read_latency_ms']:.1f} ms a call; "
            f"{r['pages']} pages written kept ({format_size(r['used_bytes'])}), {r['queued_pages']} queued, "
            f"{r['skipped_pages']} skipped")


def show_write_behind(wb: dict) -> str:
    if not wb["max_dirty_pages"]:
        return "write-behind: off (no cold tier)"
    return (f"write-behind: {wb['dirty_pages']} of {wb['max_dirty_pages']} dirty pages, lag {wb['lag_s']:.1f}s, "
            f"{wb['written_pages']} written, {wb['stranded_pages']} stranded; "
            f"producer waits {wb['backpressure_waits']} ({wb['backpressure_wait_s']:.1f}s), "
            f"refused pages {wb['refused_pages']}")


def show_pages(pages: list[dict]) -> str:
    rows = [[p["key"][:16], ",".join(p["tiers"]), p["depth"], p["refcount"],
             f"{p['pin_remaining_s']:.0f}s" if p["pinned"] else "-", p["hits"], p["namespace"][:12]] for p in pages]
    return table(rows, ["KEY", "TIERS", "DEPTH", "REFS", "PINNED", "HITS", "NAMESPACE"], right={2, 3, 4, 5})


def show_page(p: dict) -> str:
    fields = [("key", p["key"]), ("parent", p["parent"]), ("namespace", p["namespace"]), ("depth", p["depth"]),
              ("tokens", p["tokens"]), ("tiers", ", ".join(p["tiers"])), ("refcount", p["refcount"]),
              ("pinned", f"{p['pin_remaining_s']:.0f} s left" if p["pinned"] else "no"), ("hits", p["hits"]),
              ("children", p["children"])]
    return "\n".join(f"{k:<10} {v}" for k, v in fields)


def show_prefixes(got: dict) -> str:
    if not got["prefixes"]:
        return "no prefix has been reused yet"
    rows = [[p["key"][:16], p["tokens"], p["pages"], p["hits"], p["tiers"]["hot"], p["tiers"]["warm"],
             p["tiers"]["cold"], "yes" if p["complete"] else "no"] for p in got["prefixes"]]
    return table(rows, ["LAST PAGE", "TOKENS", "PAGES", "HITS", "HOT", "WARM", "COLD", "COMPLETE"],
                 right=set(range(1, 7)))


def show_lookup(got: dict) -> str:
    n, m = got["prompt_tokens"], got["cached_prefix_tokens"]
    tiers = ", ".join(f"{t} {got['tiers'][t]}" for t in TIERS)
    return f"prompt {n} tokens; cached prefix {m} tokens ({_pct(m / n if n else None)}): {tiers}"


# commands
def run(args: argparse.Namespace) -> int:
    client = client_from_args(args)
    try:
        text, answer = _run(client, args)
    except RequestFailed as exc:
        if exc.status in (404, 409):   # not found, or refused by the store
            print(f"kvstore inspect: {exc}", file=sys.stderr)
            return 1
        raise
    print(json.dumps(answer, indent=2) if args.json else text)
    return 0


def _run(client: AdminClient, args: argparse.Namespace) -> tuple[str, dict]:
    action = args.action
    if action == "stats":
        got = client.get("/v1/stats")
        return show_stats(got), got
    if action == "pages":
        pinned = {True: "true", False: "false", None: None}[args.pinned]
        got = client.get("/v1/pages", tier=args.tier, namespace=args.namespace, pinned=pinned, limit=args.limit,
                         cursor=args.cursor)
        while args.all and got["next_cursor"]:
            more = client.get("/v1/pages", tier=args.tier, namespace=args.namespace, pinned=pinned,
                              limit=args.limit, cursor=got["next_cursor"])
            got = {**more, "pages": got["pages"] + more["pages"]}
        text = show_pages(got["pages"]) + f"\n{len(got['pages'])} of {got['total']} pages"
        if got["next_cursor"]:
            text += f"; more with --cursor {got['next_cursor']}"
        return text, got
    if action == "page":
        got = client.get(f"/v1/pages/{urllib.parse.quote(args.key, safe='')}")
        return show_page(got), got
    if action == "prefixes":
        got = client.get("/v1/prefixes", limit=args.limit)
        return show_prefixes(got), got
    if action == "lookup":
        if (args.tokens is None) == (args.text is None):
            raise KVStoreError("inspect lookup: give --tokens or --text")
        body = {"tokens": parse_tokens(args.tokens)} if args.tokens is not None else {"text": args.text}
        if args.tenant:
            body["tenant"] = args.tenant
        got = client.post("/v1/lookup", body)
        return show_lookup(got), got
    if action in ("pin", "unpin"):
        body = _target(args)
        if action == "pin" and args.ttl is not None:
            body["ttl_s"] = args.ttl
        got = client.post(f"/v1/{action}", body)
        return f"{action}ned {got[action + 'ned']} of {got['requested']} pages", got
    if action == "evict":
        to = None if args.to == "out" else args.to
        got = client.post("/v1/evict", {**_target(args), "to": to})
        where = "out of the store" if to is None else f"down to {to}"
        return f"moved {got['moved']} page copies {where} ({got['requested']} pages named)", got
    if action == "flush":
        got = client.post("/v1/flush", {"tier": args.tier})
        return f"moved {got['moved']} pages out of {got['tier']}", got
    if action == "peers":
        got = client.get("/v1/peers")
        rows = [[p["instance"], p["url"], f"{p['expires'] - time.time():.1f}s"] for p in got["peers"]]
        head = f"cluster index: {got['state']}" + (f", this instance {got['instance']}" if got["instance"] else "")
        return head + ("\n" + table(rows, ["INSTANCE", "URL", "EXPIRES IN"]) if rows else "\nno live peer"), got
    if action == "forget":
        got = client.post("/v1/peers/forget", {"instance": args.instance})
        return f"removed {got['removed']} index entries of {got['instance']}", got
    raise KVStoreError(f"inspect: unknown action {action!r}")


DESCRIPTION = __doc__.split("\n\n", 1)[1]


def add_parser(subparsers) -> argparse.ArgumentParser:
    from kvstore.config import add_config_options

    p = subparsers.add_parser("inspect", help="show and steer what a running store holds (its REST admin API)",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="the admin API (default: http://ADMIN.HOST:ADMIN.PORT from the config)")
    p.add_argument("--token", help="bearer token (default: admin.token, or KVSTORE_ADMIN_TOKEN)")
    p.add_argument("--cacert", metavar="FILE", help="CA certificate for an HTTPS server (default: admin.tls_cert)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for an answer (default 10)")
    p.add_argument("--json", action="store_true", help="print the API's JSON answer")
    add_config_options(p)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("stats", help="per tier: use, pages, hit rate, evictions, promotions; bytes moved; queue; "
                                     "write-behind; drops by reason")
    a = actions.add_parser("pages", help="cached pages, in key order")
    a.add_argument("--tier", choices=TIERS)
    a.add_argument("--namespace", metavar="HEX", help="only this namespace digest")
    pin = a.add_mutually_exclusive_group()
    pin.add_argument("--pinned", dest="pinned", action="store_const", const=True, help="only pinned pages")
    pin.add_argument("--unpinned", dest="pinned", action="store_const", const=False, help="only unpinned pages")
    a.add_argument("--limit", type=int, default=50, help="pages per request (1-1000, default 50)")
    a.add_argument("--cursor", metavar="KEY", help="continue after this key (next_cursor)")
    a.add_argument("--all", action="store_true", help="follow the cursor to the end")
    a = actions.add_parser("page", help="one page by key")
    a.add_argument("key")
    a = actions.add_parser("prefixes", help="the most reused prefixes")
    a.add_argument("--limit", type=int, default=20)
    a = actions.add_parser("lookup", help="how much of a prompt is cached, and in which tiers")
    a.add_argument("--tokens", metavar="IDS", help="token ids: 1,2,3 or '1 2 3' or @FILE")
    a.add_argument("--text", help="prompt text (the server must run a model)")
    a.add_argument("--tenant", default="")
    for name, help in (("pin", "keep pages (or a prefix) where they are"), ("unpin", "unpin pages (or a prefix)"),
                       ("evict", "move pages (or a prefix) down a tier, or out")):
        a = actions.add_parser(name, help=help)
        a.add_argument("keys", nargs="*", metavar="KEY", help="page keys (hex)")
        a.add_argument("--tokens", metavar="IDS", help="a prefix instead: token ids (1,2,3 or @FILE)")
        a.add_argument("--tenant", default="", help="the tenant of --tokens")
        if name == "pin":
            a.add_argument("--ttl", type=float, metavar="S", help="seconds (default: the server's pin_ttl_s)")
        if name == "evict":
            a.add_argument("--to", required=True, choices=("warm", "cold", "out"),
                           help="warm: out of hot; cold: out of hot and warm; out: out of the store")
    a = actions.add_parser("flush", help="move every page that may leave a tier one tier down")
    a.add_argument("tier", choices=TIERS)
    actions.add_parser("peers", help="the cross-instance index: its state and the live instances")
    a = actions.add_parser("forget", help="remove every index entry of one (dead) instance")
    a.add_argument("instance", help="the instance id, as `peers` lists it")
    p.set_defaults(func=run)
    return p
