"""Fetching pages from peer instances over HTTP.

The serving side answers `POST /v1/peer/pages` (JSON {"namespace": hex, "keys": [hex, ...]},
a prefix chain) with a stream of frames, each a 4-byte big-endian length and one page record
in the cold tier's format (kvstore.pages.record: header, checksum, page bytes), in chain order,
ending at the first page it does not hold. It requires the cluster token as a bearer token:
without cluster.token an instance serves no pages to peers (403) and fetches none from them
(whatever a peer requires, an empty token never matches it).

The fetching side verifies every record (checksum, key derivation, namespace, geometry, the
tokens it expects, the chain) before the page goes into its warm tier; the first bad or
missing record ends the fetch, and what was fetched before it is still used. It fetches only
when that is estimated cheaper than recomputing (measured bandwidth against prefill speed),
unless cluster.fetch_policy says otherwise.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import struct
import time
from typing import Callable, Sequence

import aiohttp
from aiohttp import web

from kvstore.errors import KVStoreError
from kvstore.pages import record
from kvstore.pages.keys import Namespace, page_keys, tokens_bytes

log = logging.getLogger("kvstore.peer")
FRAME = struct.Struct(">I")
MAX_KEYS = 8192
CONTENT_TYPE = "application/x-kvstore-pages"
MAX_ERROR_CHARS = 200       # of a peer's error answer, in the log
NO_TOKEN = "cluster.token is not set: peers cannot fetch pages from this instance, nor it from them"


def _authorized(request: web.Request, token: str) -> bool:
    # aiohttp decodes header bytes as UTF-8 with surrogateescape: encoding back gives the bytes sent
    given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    return bool(token) and hmac.compare_digest(given, f"Bearer {token}".encode())


async def serve_pages(request: web.Request, store, token: str) -> web.StreamResponse:
    """POST /v1/peer/pages: this instance's pages of a prefix chain, for a peer holding the token."""
    if not token:
        return web.json_response({"error": "peer fetch is disabled: set cluster.token"}, status=403)
    if not _authorized(request, token):
        return web.json_response({"error": "missing or wrong cluster token"}, status=401)
    try:
        body = await request.json()
        ns = bytes.fromhex(body["namespace"])
        keys = [bytes.fromhex(k) for k in body["keys"]]
        if len(ns) != 32 or not keys or len(keys) > MAX_KEYS or any(len(k) != 32 for k in keys):
            raise ValueError
    except (ValueError, KeyError, TypeError, AttributeError, json.JSONDecodeError):
        return web.json_response({"error": "body must be {\"namespace\": 64 hex, \"keys\": [64 hex, ...]} "
                                           f"with 1 to {MAX_KEYS} keys"}, status=400)
    records = await store.daemon.run(store.export_records, ns, keys)
    resp = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE})
    await resp.prepare(request)
    for rec in records:
        await resp.write(FRAME.pack(len(rec)) + rec)
    await resp.write_eof()
    return resp


class PeerFetcher:
    """Pulls a prompt's cached prefix from the peer that holds the longest one."""

    def __init__(self, store, index, token: str, policy: str = "auto",
                 prefill_tokens_per_s: Callable[[], float] = lambda: 2000.0):
        self.store, self.daemon, self.index = store, store.daemon, index
        self.token, self.policy = token, policy
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.bandwidth = 200e6          # bytes/s, measured as fetches happen (EWMA)
        self.latency = 0.005            # seconds per fetch, likewise
        self.fetched_pages = self.failed = self.skipped = 0
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def worth_it(self, pages: int) -> bool:
        if self.policy != "auto":
            return self.policy == "always"
        tokens = pages * self.store.spec.page_size
        fetch_s = self.latency + pages * self.store.spec.page_bytes / self.bandwidth
        return fetch_s < tokens / max(self.prefill_tokens_per_s(), 1e-9)

    async def prefetch(self, tokens: Sequence[int], ns: Namespace) -> tuple[int, int]:
        """Fetch the pages of `tokens` that a live peer holds beyond the local prefix.
        Returns (pages cached locally before, pages added from the peer)."""
        ps = self.store.spec.page_size
        keys = page_keys(ns, tokens[:len(tokens) - 1], ps)   # the last token is always computed
        if not keys or self.index is None:
            return 0, 0
        local = (await self.daemon.run(self.store.match, tokens[:len(tokens) - 1], ns)).num_pages
        if not self.token:      # no peer would answer; the start-up warning said why
            return local, 0
        peers = [p for p in await self.index.lookup(ns.digest, keys) if p["pages"] > local and p["url"]]
        if not peers:
            return local, 0
        best = peers[0]
        if not self.worth_it(best["pages"] - local):
            self.skipped += 1
            return local, 0
        want = keys[local:best["pages"]]
        expect = [tokens_bytes(tokens[i * ps:(i + 1) * ps]) for i in range(local, best["pages"])]
        parent = keys[local - 1] if local else ns.digest
        try:
            got = await self._fetch(best["url"], ns, want, expect, parent)
        except (aiohttp.ClientError, OSError, TimeoutError, KVStoreError) as exc:
            self.failed += 1
            log.warning("peer fetch from %s failed: %s", best["instance"], str(exc) or type(exc).__name__)
            return local, 0
        added = await self.daemon.run(self.store.import_records, got) if got else 0
        self.fetched_pages += added
        return local, added

    async def _fetch(self, url: str, ns: Namespace, keys: list[bytes], expect: list[bytes], parent: bytes):
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60, sock_connect=2))
        t0 = time.monotonic()
        body = {"namespace": ns.digest.hex(), "keys": [k.hex() for k in keys]}
        headers = {"Authorization": f"Bearer {self.token}"}
        out, nbytes = [], 0
        async with self._session.post(f"{url.rstrip('/')}/v1/peer/pages", json=body, headers=headers) as resp:
            if resp.status != 200:
                raise KVStoreError(f"peer answered {resp.status}: {await _error_text(resp)}")
            for key, tok in zip(keys, expect):
                try:
                    head = await resp.content.readexactly(FRAME.size)
                except (asyncio.IncompleteReadError, aiohttp.ClientPayloadError):
                    break   # the peer holds no more of the chain
                (n,) = FRAME.unpack(head)
                if n > self.store.spec.page_bytes + 4096:
                    break
                data = await resp.content.readexactly(n)
                try:
                    header, payload = record.decode(data)
                except record.RecordError:
                    break
                if (header.key != key or header.parent != parent or header.namespace != ns.digest
                        or header.tokens != tok or header.spec != self.store.spec.fingerprint
                        or header.nbytes != self.store.spec.page_bytes):
                    break   # never take a page that is not exactly the one asked for
                out.append((header, bytes(payload)))
                nbytes += n
                parent = key
        dt = time.monotonic() - t0
        if out:
            self.bandwidth = 0.7 * self.bandwidth + 0.3 * (nbytes / max(dt, 1e-6))
            self.latency = 0.7 * self.latency + 0.3 * min(dt, 1.0)
        return out

    def stats(self) -> dict:
        return {"fetched_pages": self.fetched_pages, "failed": self.failed, "skipped": self.skipped,
                "bandwidth_bytes_per_s": self.bandwidth, "policy": self.policy}


async def _error_text(resp: aiohttp.ClientResponse) -> str:
    """The `error` of a peer's JSON answer (its text when not JSON), one line, shortened."""
    try:
        text = (await resp.content.read(4096)).decode("utf-8", "replace")
        error = json.loads(text).get("error", text) if text.lstrip().startswith("{") else text
    except (aiohttp.ClientError, ValueError, AttributeError):
        return resp.reason or "no reason given"
    error = " ".join(str(error).split()) or resp.reason or "no reason given"
    return error if len(error) <= MAX_ERROR_CHARS else error[:MAX_ERROR_CHARS - 3] + "..."
