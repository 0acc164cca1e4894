"""The admin API's OpenAPI 3.1 document, served at /openapi.json.

The request schemas and parameters are the one statement of what admin.py accepts: validate.py
validates every request against them (JSON Schema Draft 2020-12, the dialect of OpenAPI 3.1) and
refuses fields and query parameters they do not name. The tests validate every response against
the response schemas and generate requests from the request schemas.
"""

from __future__ import annotations

import copy

from kvstore import __version__
from kvstore.movement.move_stats import DROP_REASONS
from kvstore.placement.index import CACHE_TIERS

HEX_KEY = "^[0-9a-fA-F]{64}$"
MAX_TOKEN_ID = 2**31 - 1
MAX_TENANT_CHARS = 256
MAX_TTL_S = 365 * 24 * 3600
MAX_LIMIT = 1000
TIERS = ["hot", "warm", "cold"]


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _int(minimum: int = 0) -> dict:
    return {"type": "integer", "minimum": minimum}


def _obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": properties, "additionalProperties": False,
            "required": list(properties) if required is None else required, **extra}


_KEY = {"type": "string", "pattern": HEX_KEY, "description": "a page key or namespace digest, 64 hex digits"}
_TIER_COUNTS = _obj({t: _int() for t in TIERS})

# request bodies: `keys` or `tokens` (a prefix, in `tenant`'s namespace), never both
_TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID},
           "description": "token ids"}
_KEYS = {"type": "array", "items": {"type": "string", "pattern": HEX_KEY}, "description": "page keys (hex)"}
_TENANT = {"type": "string", "maxLength": MAX_TENANT_CHARS,
           "description": "the tenant whose namespace `tokens` are in (default: none)"}
_TTL = {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_TTL_S,
        "description": "seconds the pin lasts (default: config pin_ttl_s)"}
_KEYS_OR_TOKENS = [{"required": ["keys"]}, {"required": ["tokens"]}]

# store.stats()["write_behind"], the part of it /readyz shows, and the drops by reason
_WRITE_BEHIND = {
    "dirty_pages": {**_int(), "description": "pages in memory not yet written to cold (the write-behind queue)"},
    "dirty_bytes": {**_int(), "description": "their bytes"},
    "max_dirty_pages": {**_int(), "description": "the bound on dirty pages (daemon.max_dirty_bytes, at most half "
                                                 "the warm tier); 0 without a cold tier"},
    "queued_pages": {**_int(), "description": "dirty pages waiting for a write"},
    "writing_pages": {**_int(), "description": "dirty pages in a write now"},
    "lag_s": {"type": "number", "minimum": 0, "description": "age in seconds of the oldest dirty page (0 when none)"},
    "written_pages": {**_int(), "description": "pages written to cold (counter)"},
    "write_batches": {**_int(), "description": "write-behind batches run, failed ones included (counter)"},
    "stranded_pages": {**_int(), "description": "dirty pages cold refused (full, or failing writes): retried every "
                                                "few seconds, and they may be dropped"},
    "backpressure_waits": {**_int(), "description": "producers (sidecar puts, peer imports) that waited for room "
                                                    "(counter)"},
    "backpressure_wait_s": {"type": "number", "minimum": 0, "description": "seconds they waited (counter)"},
    "refused_pages": {**_int(), "description": "pages producers did not store after waiting their bound (counter)"},
}
_DROPPED = _obj({reason: _int() for reason in DROP_REASONS},
                description="pages that left the store with no copy below, by reason: no_cold_tier (a store "
                            "without one evicting from memory), cold_full (cold at its limit could not evict for "
                            "them), write_error (the disk failed their writes)")
_READY_WRITE_BEHIND = ("dirty_pages", "max_dirty_pages", "lag_s", "stranded_pages")


def _target(required: list[str], **more) -> dict:
    """A request naming pages by key, or a prefix by tokens."""
    return _obj({"keys": _KEYS, "tokens": _TOKENS, "tenant": _TENANT, **more}, required=required,
                oneOf=_KEYS_OR_TOKENS)


SCHEMAS = {
    "Error": _obj({"error": {"type": "string", "description": "what went wrong, one line"}}),
    "Health": _obj({"status": {"const": "ok"}}),
    "Ready": _obj({"ready": {"type": "boolean"},
                   "checks": _obj({"store": {"type": "boolean", "description": "the store is open"},
                                   "engine": {"type": "boolean", "description": "the engine's warm-up is done"},
                                   "accepting": {"type": "boolean", "description": "not draining"}}),
                   "cluster": {"enum": ["connected", "disconnected", "disabled"],
                               "description": "the cross-instance index (disconnected: local-only mode, "
                                              "still ready)"},
                   "peers": _obj({"serving": {"type": "boolean", "description": "peers can fetch pages from "
                                                                                "this instance"},
                                  "fetching": {"type": "boolean", "description": "this instance fetches pages "
                                                                                 "from peers"},
                                  "reason": {"type": ["string", "null"], "description": "why not, when not"}},
                                 description="page sharing between instances (cluster.token); does not hold "
                                             "readiness back"),
                   "cold_index": _obj({"done": {"type": "boolean"},
                                       "pages": {**_int(), "description": "cold records indexed so far"}},
                                      description="the cold tier is indexed in the background after a start; "
                                                  "the store serves meanwhile (cold pages appear as they are "
                                                  "indexed), so this does not hold readiness back"),
                   "cold": _ref("ColdState"),
                   "write_behind": _obj({k: _WRITE_BEHIND[k] for k in _READY_WRITE_BEHIND},
                                        description="write-behind to cold now; does not hold readiness back"),
                   "dropped_by_reason": _DROPPED,
                   "remote": _obj({"state": {"enum": ["up", "down", "disabled"]},
                                   "last_error": {"type": "string"}},
                                  description="the remote tier; down (its pages are misses) does not hold "
                                              "readiness back")}),
    "ColdState": _obj({"enabled": {"type": "boolean"},
                       "write_errors": {**_int(), "description": "write-behind batches that failed (their pages "
                                                                 "stayed in memory)"},
                       "last_error": {"type": "string", "description": "the last write failure, one line"},
                       "full": {"type": "boolean", "description": "the last write found no room (disk, map or "
                                                                 "cold.max_bytes), even after evicting"},
                       "evicted_for_room": {**_int(), "description": "cold records evicted because the disk or "
                                                                     "the map filled up before cold.max_bytes"},
                       "disk_bound": {"type": "boolean", "description": "the disk (free space, cold.map_size_max) "
                                                                       "holds less than cold.max_bytes: cold evicts "
                                                                       "at the disk's limit"}},
                      description="the cold tier's write health; a full cold tier does not hold readiness back"),
    "TierStats": _obj({
        "capacity_bytes": _int(), "used_bytes": _int(), "pages": _int(), "referenced_pages": _int(),
        "pinned_pages": _int(), "allocated_pages": _int(),
        "high_watermark": {"type": "number"}, "low_watermark": {"type": "number"},
        "hits": _int(), "misses": _int(), "evictions": _int(), "promotions": _int(),
        "hit_rate": {"type": ["number", "null"], "minimum": 0, "maximum": 1,
                     "description": "hits / (hits + misses); null before the first lookup"}},
        required=["capacity_bytes", "used_bytes", "pages", "referenced_pages", "pinned_pages", "high_watermark",
                  "low_watermark", "hits", "misses", "evictions", "promotions", "hit_rate"],
        additionalProperties=True),
    "RemoteStats": _obj({
        "url": {"type": "string", "description": "remote.url, its password hidden"},
        "state": {"enum": ["up", "down"], "description": "down: calls fail fast until a retry (backoff)"},
        "last_error": {"type": "string", "description": "why it is down, one line (empty when up)"},
        "write": {"type": "boolean", "description": "remote.write: pages written to cold go to it too"},
        "capacity_bytes": {**_int(), "description": "remote.max_bytes, this instance's budget (0: none)"},
        "used_bytes": {**_int(), "description": "bytes of the records this instance wrote and has not deleted"},
        "pages": {**_int(), "description": "those records"},
        "hits": {**_int(), "description": "pages read from it, verified"},
        "misses": {**_int(), "description": "lookups that ended at a page it does not hold, or a bad one"},
        "corrupt_pages": {**_int(), "description": "values that failed verification (damaged, foreign, truncated)"},
        "errors": {**_int(), "description": "calls that failed (unreachable, timed out)"},
        "read_bytes": _int(), "read_latency_ms": {"type": "number", "minimum": 0,
                                                  "description": "mean time of a read call"},
        "queued_pages": {**_int(), "description": "pages waiting to be written to it"},
        "written_pages": _int(), "write_batches": _int(),
        "skipped_pages": {**_int(), "description": "pages not written: the queue was full (remote.queue_pages)"},
        "already_present_pages": {**_int(), "description": "pages not written: it held them already"},
        "deleted_pages": {**_int(), "description": "records deleted to keep within remote.max_bytes"},
        "hit_rate": {"type": ["number", "null"], "minimum": 0, "maximum": 1}},
        required=["url", "state", "hits", "misses", "corrupt_pages", "errors", "read_latency_ms"],
        description="the remote tier (remote.url), present when configured"),
    "EngineStats": _obj({"waiting": _int(), "running": _int(), "preemptions": _int(), "computed_tokens": _int()},
                        additionalProperties=True),   # the engine's stats() may grow
    "Stats": _obj({
        "page_bytes": _int(1), "spec": {"type": "string"},
        "tiers": _obj({**{t: _ref("TierStats") for t in TIERS}, "remote": _ref("RemoteStats")}, required=TIERS),
        "bytes_moved": {"type": "object", "additionalProperties": _int(),
                        "description": "bytes copied between tiers, by direction (e.g. hot_to_warm)"},
        "entries": _int(), "corrupt_pages": _int(), "mismatched_pages": _int(), "cold": _ref("ColdState"),
        "dropped_pages": {**_int(), "description": "the sum of dropped_by_reason"},
        "dropped_by_reason": _DROPPED,
        "write_behind": _obj(_WRITE_BEHIND, description="the write-behind queue to cold and the producers' "
                                                        "backpressure"),
        "eviction_policy": {"type": "string"}, "write_policy": {"type": "string"},
        "queue_depth": {**_int(), "description": "requests waiting in the engine (0 without an engine)"},
        "running": {**_int(), "description": "requests the engine is running (0 without an engine)"},
        "engine": {"oneOf": [_ref("EngineStats"), {"type": "null"}]},
        "uptime_s": {"type": "number", "minimum": 0}},
        additionalProperties=True),  # the store's stats may grow
    "Page": _obj({
        "key": _KEY, "parent": _KEY, "namespace": _KEY,
        "depth": {**_int(), "description": "the page's index in its sequence"},
        "tokens": {**_int(1), "description": "tokens in the page (the page size)"},
        "tier": {"enum": TIERS, "description": "the fastest tier holding it"},
        "tiers": {"type": "array", "items": {"enum": TIERS}, "uniqueItems": True},
        "refcount": _int(), "pinned": {"type": "boolean"},
        "pin_remaining_s": {"type": ["number", "null"], "minimum": 0},
        "hits": _int(), "last_access": {**_int(), "description": "index tick of the last use"},
        "children": _int()}),
    "PageList": _obj({"pages": {"type": "array", "items": _ref("Page")},
                      "next_cursor": {"type": ["string", "null"], "pattern": HEX_KEY},
                      "total": {**_int(), "description": "pages matching the filters"}}),
    "Prefix": _obj({
        "key": {**_KEY, "description": "the key of the prefix's last page"}, "namespace": _KEY,
        "pages": _int(1), "tokens": _int(1), "hits": _int(1),
        "complete": {"type": "boolean", "description": "every page back to the first is cached"},
        "tiers": {**_TIER_COUNTS, "description": "pages by the fastest tier holding them"},
        "last_access": _int()}),
    "PrefixList": _obj({"prefixes": {"type": "array", "items": _ref("Prefix")}, "page_size": _int(1)}),
    "LookupResult": _obj({
        "prompt_tokens": _int(), "cached_prefix_tokens": _int(), "cached_pages": _int(),
        "tiers": {**_TIER_COUNTS, "description": "cached tokens by the fastest tier holding them"},
        "peers": {"type": "array", "description": "live instances holding a prefix of the prompt",
                  "items": _obj({"instance": {"type": "string"}, "tokens": _int(1),
                                 "tier": {"enum": TIERS, "description": "its best tier for them"}})}}),
    "Peers": _obj({"state": {"enum": ["connected", "disconnected", "disabled"]},
                   "instance": {"type": ["string", "null"], "description": "this instance's id"},
                   "peers": {"type": "array", "items": _obj({"instance": {"type": "string"},
                                                             "url": {"type": "string"},
                                                             "expires": {"type": "number"}})}}),
    "ForgetResult": _obj({"instance": {"type": "string"}, "removed": _int()}),
    "PinResult": _obj({"requested": _int(), "pinned": _int()}),
    "UnpinResult": _obj({"requested": _int(), "unpinned": _int()}),
    "EvictResult": _obj({"requested": _int(), "moved": {**_int(), "description": "page copies removed from tiers"},
                         "to": {"enum": ["warm", "cold", None]}}),
    "FlushResult": _obj({"tier": {"enum": TIERS}, "moved": _int()}),
}

REQUESTS = {
    "LookupRequest": _obj({"tokens": _TOKENS, "text": {"type": "string", "description": "needs an engine"},
                           "tenant": _TENANT}, required=[],
                          oneOf=[{"required": ["tokens"]}, {"required": ["text"]}]),
    "PinRequest": _target([], ttl_s=_TTL),
    "UnpinRequest": _target([]),
    "EvictRequest": _target(["to"], to={"enum": ["warm", "cold", None],
                                        "description": "warm: out of hot; cold: out of hot and warm; "
                                                       "null: out of the store"}),
    "FlushRequest": _obj({"tier": {"enum": TIERS}}),
    "ForgetRequest": _obj({"instance": {"type": "string", "minLength": 1}}),
    "PeerPagesRequest": _obj({"namespace": _KEY, "keys": {"type": "array", "items": _KEY, "minItems": 1}}),
}


def _json(schema: dict | str, description: str = "OK") -> dict:
    return {"description": description,
            "content": {"application/json": {"schema": _ref(schema) if isinstance(schema, str) else schema}}}


def _errors(*codes: int) -> dict:
    what = {400: "bad input", 401: "missing or wrong bearer token", 404: "not found",
            409: "the store refused the operation", 413: "the body is over admin.max_body_bytes"}
    return {str(c): _json("Error", what[c]) for c in codes}


def _query(name: str, schema: dict, description: str) -> dict:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


_LIMIT = {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT}
_AUTH = [{"bearer": []}]
_OPEN: list = []


def _get(summary: str, ok: dict, *codes: int, params: list | None = None, security: list | None = None) -> dict:
    op = {"summary": summary, "responses": {"200": ok, **_errors(*codes)}}
    if params:
        op["parameters"] = params
    if security is not None:
        op["security"] = security
    return {"get": op}


def _post(summary: str, request: str, result: str, *codes: int) -> dict:
    return {"post": {"summary": summary,
                     "requestBody": {"required": True,
                                     "content": {"application/json": {"schema": _ref(request)}}},
                     "responses": {"200": _json(result), **_errors(400, 401, 413, *codes)}}}


PATHS = {
    "/healthz": _get("liveness: 200 while the process serves", _json("Health"), security=_OPEN),
    "/readyz": {"get": {"summary": "readiness: the store open and the engine warmed up (and how far the cold "
                                   "tier's background indexing is, its write health, write-behind and drops)",
                        "security": _OPEN,
                        "responses": {"200": _json("Ready"), "503": _json("Ready", "not ready")}}},
    "/": _get("the dashboard (HTML; asks for the token and sends it on its data requests)",
              {"description": "OK", "content": {"text/html": {"schema": {"type": "string"}}}}, security=_OPEN),
    "/v1/stats": _get("per tier: capacity, use, hits, misses, evictions, promotions; bytes moved; write-behind "
                      "and backpressure; drops by reason; queue",
                      _json("Stats"), 401),
    "/v1/pages": _get("cached pages, by key order, filtered and paginated", _json("PageList"), 400, 401, params=[
        _query("tier", {"enum": TIERS}, "only pages in this tier"),
        _query("namespace", {"type": "string", "pattern": HEX_KEY}, "only pages of this namespace digest"),
        _query("pinned", {"type": "boolean"}, "only pinned (true) or unpinned (false) pages"),
        _query("limit", _LIMIT, "pages per answer (default 100)"),
        _query("cursor", {"type": "string", "pattern": HEX_KEY}, "next_cursor of the previous answer")]),
    "/v1/pages/{key}": {"get": {
        "summary": "one page", "parameters": [{"name": "key", "in": "path", "required": True, "schema": _KEY}],
        "responses": {"200": _json("Page"), **_errors(400, 401, 404)}}},
    "/v1/prefixes": _get("the most reused prefixes: chains of pages ranked by hits", _json("PrefixList"), 400, 401,
                         params=[_query("limit", _LIMIT, "prefixes to list (default 20)")]),
    "/v1/lookup": _post("how much of a prompt is cached, and where", "LookupRequest", "LookupResult"),
    "/v1/pin": _post("keep pages (or a prefix) where they are until unpinned or ttl_s passes", "PinRequest",
                     "PinResult"),
    "/v1/unpin": _post("unpin pages (or a prefix)", "UnpinRequest", "UnpinResult"),
    "/v1/evict": _post("move pages (or a prefix) down a tier, or out of the store", "EvictRequest",
                       "EvictResult", 409),
    "/v1/flush": _post("move every page that may leave a tier one tier down", "FlushRequest", "FlushResult", 409),
    "/v1/peers": _get("the cluster index: its state, this instance and the live peers", _json("Peers"), 401),
    "/v1/peers/forget": _post("remove every index entry of one instance (a dead one)", "ForgetRequest",
                              "ForgetResult", 409),
    "/v1/peer/pages": {"post": {
        "summary": "a prefix chain's page records, streamed, for peers holding cluster.token",
        "security": [{"cluster": []}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("PeerPagesRequest")}}},
        "responses": {"200": {"description": "frames: 4-byte big-endian length + one page record",
                              "content": {"application/x-kvstore-pages": {"schema": {"type": "string"}}}},
                      **_errors(400, 401), "403": _json("Error", "peer fetch is disabled (no cluster.token)")}}},
    "/v1/config": _get("the effective config, secrets redacted", _json({"type": "object"}), 401),
    "/metrics": _get("Prometheus metrics (text format)",
                     {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}, 401),
    "/openapi.json": _get("this document", _json({"type": "object"}), 401),
}

# /v1/history: the dashboard's time series (kvstore/server/history.py)
_RATIO = {"type": ["number", "null"], "minimum": 0, "maximum": 1}
_RATE = {"type": "number", "minimum": 0}
_NUMBER = {"type": ["number", "null"], "minimum": 0}
SCHEMAS["HistorySample"] = _obj({
    "t": {"type": "number", "description": "unix time of the reading"},
    "elapsed_s": {"type": "number", "minimum": 0, "description": "seconds since the previous reading"},
    "occupancy": {**_obj({t: _NUMBER for t in TIERS}), "description": "used / capacity bytes (null: no tier)"},
    "hit_rate": {**_obj({t: _RATIO for t in CACHE_TIERS}),
                 "description": "prompt tokens served from each tier / prompt tokens (null: no requests)"},
    "requests_per_s": _RATE, "prompt_tokens_per_s": _RATE, "generation_tokens_per_s": _RATE,
    "ttft_p50_s": _NUMBER, "ttft_p99_s": _NUMBER,
    "bytes_moved_per_s": {**_obj({"up": _RATE, "down": _RATE}), "description": "copies towards hot, and away"},
    "queue_depth": _int(), "running": _int()})
SCHEMAS["History"] = _obj({
    "interval_s": {"type": "number", "exclusiveMinimum": 0}, "size": {**_int(1), "description": "samples kept"},
    "server": _obj({"model": {"type": ["string", "null"], "description": "null without an engine"},
                    "instance": {"type": "string"}, "version": {"type": "string"},
                    "uptime_s": {"type": "number", "minimum": 0},
                    "default_namespace": {**_KEY, "description": "the namespace digest of requests without a "
                                                                 "tenant"}}),
    "watermarks": _obj({t: _obj({"low": {"type": "number"}, "high": {"type": "number"}}) for t in TIERS}),
    "samples": {"type": "array", "items": _ref("HistorySample"), "description": "oldest first"}})
PATHS["/v1/history"] = _get("the last minutes, one sample per interval_s: tier occupancy, token hit rate per "
                            "tier, requests/s, TTFT P50/P99, bytes moved, queue", _json("History"), 401)

DOCUMENT = {
    "openapi": "3.1.0",
    "info": {"title": "kvstore admin API", "version": __version__,
             "description": "Inspect and steer a kvstore's tiered KV cache. Errors are JSON {\"error\": \"...\"}; "
                            "a request is checked against its operation here (400 names the field and what "
                            "it allows); fields and query parameters not named here are refused. "
                            "When admin.token is set, every path except /healthz, /readyz and / needs "
                            "`Authorization: Bearer <token>`."},
    "paths": PATHS,
    "components": {"schemas": {**SCHEMAS, **REQUESTS},
                   "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                       "cluster": {"type": "http", "scheme": "bearer",
                                                   "description": "cluster.token, shared by the instances"}}},
    "security": _AUTH,
}


def document() -> dict:
    """A copy of the OpenAPI document."""
    return copy.deepcopy(DOCUMENT)
