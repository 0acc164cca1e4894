"""The admin server's defences: bad input is answered 400/413, never a 500; the bearer token on every
protected route; the loopback check before binding; TLS; and, with an engine, logs without prompt content.
The server and its fixtures are test_admin's."""

from __future__ import annotations

import json
import logging
import ssl
import subprocess
from pathlib import Path

import aiohttp
import pytest

from kvstore.errors import KVStoreError
from kvstore.server import create_admin_app, start_admin
from kvstore.server.admin import check_exposure
from storeutil import make_config, make_store
from test_admin import PS, TOKEN, running_admin, secured  # noqa: F401 (secured: the fixture)


# errors: never a 500 for bad input
async def test_malformed_and_oversized_bodies(tmp_path):
    async with running_admin(tmp_path, **{"admin.max_body_bytes": "4KiB"}) as admin:
        for raw in (b"{", b"", b"[1, 2]", b'"text"', b"null", b'{"tier": NaN}', b'{"tier": Infinity}',
                    b"\xff\xfe\x00garbage", b"[" * 4000):
            status, got = await admin.post("/v1/flush", data=raw, headers={"Content-Type": "application/json"})
            assert status == 400 and "JSON" in got["error"], raw[:20]
        big = json.dumps({"tokens": list(range(2000))}).encode()
        assert len(big) > 4096
        status, got = await admin.post("/v1/lookup", data=big, headers={"Content-Type": "application/json"})
        assert status == 413 and "4096" in got["error"]
        status, got = await admin.post("/v1/lookup", {"tokens": list(range(500))})   # under the limit
        assert status == 200
        status, got, headers = await admin.request("DELETE", "/v1/stats")
        assert status == 405 and "GET" in headers["Allow"]
        status, got, _ = await admin.request("GET", "/v1/flush")
        assert status == 405
        status, got, _ = await admin.request("GET", "/v2/stats")
        assert status == 404 and got["error"]
        assert (await admin.get("/healthz"))[0] == 200


# auth
def _operations(doc: dict, key: str):
    bodies = {"/v1/lookup": {"tokens": [1, 2]}, "/v1/pin": {"keys": [key]}, "/v1/unpin": {"keys": [key]},
              "/v1/evict": {"keys": [key], "to": "warm"}, "/v1/flush": {"tier": "warm"},
              "/v1/peers/forget": {"instance": "gone"},
              "/v1/peer/pages": {"namespace": key, "keys": [key]}}
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            yield method.upper(), path.replace("{key}", key), bodies.get(path), op.get("security", doc["security"])


async def test_auth_on_every_protected_endpoint(secured):
    key = next(iter(secured.store.index.entries)).hex()
    protected = 0
    expected = {"/v1/peers/forget": 409}   # no cluster index in this server
    for method, path, body, security in _operations(secured.doc, key):
        if security == [{"cluster": []}]:   # peers present cluster.token, not the admin token
            status, _, _ = await secured.request(method, path, body)
            assert status == 403, path      # no cluster.token: peer fetch disabled
            continue
        if not security:   # /healthz, /readyz and the dashboard page are open
            status, _, _ = await secured.request(method, path, body, token="")
            assert status in (200, 503), path
            continue
        protected += 1
        for headers in ({}, {"Authorization": "Bearer wrong-token"}, {"Authorization": f"Basic {TOKEN}"},
                        {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": TOKEN},
                        {"Authorization": "Bearer"}):
            status, got, resp_headers = await secured.request(method, path, body, token="", headers=headers)
            assert status == 401, (method, path, headers)
            assert resp_headers["WWW-Authenticate"].startswith("Bearer") and "token" in got["error"]
        status, _, _ = await secured.request(method, path, body)
        assert status == expected.get(path, 200), (method, path)
        status, _, _ = await secured.request(method, path, body, token="",
                                             headers={"Authorization": f"bearer  {TOKEN}"})
        assert status == expected.get(path, 200), (method, path)
    assert protected == 15   # 14 and /v1/history
    # unknown paths do not reveal themselves without the token
    assert (await secured.request("GET", "/v1/secret", token=""))[0] == 401
    assert (await secured.request("GET", "/v1/secret"))[0] == 404


def test_a_token_from_the_environment_allows_exposure():
    from kvstore.config import load_config
    config = load_config(env={"KVSTORE_ADMIN_TOKEN": TOKEN, "KVSTORE_ADMIN_HOST": "0.0.0.0"})
    assert config.admin.token == TOKEN
    check_exposure(config)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7", "example.org", ""])
def test_refuses_a_non_loopback_address_without_a_token(tmp_path, host):
    config = make_config(tmp_path, **{"admin.host": host, "admin.port": 0})
    with pytest.raises(KVStoreError, match="not a loopback address: set admin.token") as exc:
        check_exposure(config)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost"])
def test_loopback_needs_no_token(tmp_path, host):
    check_exposure(make_config(tmp_path, **{"admin.host": host}))


async def test_start_refuses_before_binding(tmp_path):
    store = make_store(tmp_path / "data")
    try:
        config = make_config(tmp_path / "data", **{"admin.host": "0.0.0.0", "admin.port": 0})
        with pytest.raises(KVStoreError, match="not a loopback address"):
            await start_admin(create_admin_app(store, config), config)
        # with a token it binds every interface; this test only talks to it over loopback
        config = make_config(tmp_path / "data", **{"admin.host": "0.0.0.0", "admin.port": 0, "admin.token": TOKEN})
        runner = await start_admin(create_admin_app(store, config), config)
        try:
            port = runner.addresses[0][1]
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/v1/stats") as r:
                assert r.status == 401
        finally:
            await runner.cleanup()
    finally:
        store.close()


async def test_port_in_use_is_one_line(tmp_path):
    async with running_admin(tmp_path) as admin:
        port = admin.runner.addresses[0][1]
        config = make_config(tmp_path / "data", **{"admin.port": port})
        with pytest.raises(KVStoreError, match=f"cannot listen on 127.0.0.1:{port}"):
            await start_admin(create_admin_app(admin.store, config), config)


# TLS
def make_cert(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "admin.crt", directory / "admin.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return cert, key


async def test_tls(tmp_path):
    cert, key = make_cert(tmp_path)
    ctx = ssl.create_default_context(cafile=str(cert))
    async with running_admin(tmp_path, token=TOKEN, client_ssl=ctx,
                             **{"admin.tls_cert": cert, "admin.tls_key": key}) as admin:
        assert admin.url.startswith("https://127.0.0.1:")
        assert (await admin.get("/v1/stats"))[0] == 200
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.ClientConnectorCertificateError):   # not trusted without the cert
                async with s.get(admin.url + "/healthz") as r:
                    await r.read()
            with pytest.raises(aiohttp.ClientError):   # no plain HTTP
                async with s.get(admin.url.replace("https", "http") + "/healthz") as r:
                    await r.read()
    for extra in ({"admin.tls_cert": cert}, {"admin.tls_key": key},
                  {"admin.tls_cert": tmp_path / "missing.crt", "admin.tls_key": key}):
        config = make_config(tmp_path / "data", **{"admin.port": 0, **extra})
        with pytest.raises(KVStoreError, match="tls_"):
            await start_admin(create_admin_app(None, config), config)


# with the engine: text lookups, the queue, readiness, and logs without content
SECRET_TEXT = "zebra-quartz-7731 confidential prompt " * 3


@pytest.fixture
def llm(tmp_path):
    from engine import LLM
    from engine.config import load_config
    config = load_config(None, {}, {"data_dir": str(tmp_path / "llm"), "hot.device": "cpu", "hot.pool": "8MiB",
                                    "warm.bytes": "8MiB"})
    llm = LLM("tiny", config=config)
    yield llm
    llm.close()


async def test_with_an_engine(tmp_path, llm, caplog):
    from engine import SamplingParams
    caplog.set_level(logging.DEBUG)
    llm.generate(SECRET_TEXT, SamplingParams(max_tokens=2, temperature=0.0))
    ids = llm.tokenizer.encode(SECRET_TEXT)
    async with running_admin(tmp_path, engine=llm, store=llm.store) as admin:
        status, got = await admin.post("/v1/lookup", {"text": SECRET_TEXT})
        assert status == 200 and got["prompt_tokens"] == len(ids)
        assert got["cached_prefix_tokens"] == len(ids) // PS * PS > 0
        assert (await admin.post("/v1/lookup", {"tokens": ids}))[1] == got
        _, stats = await admin.get("/v1/stats")
        assert stats["engine"] == llm.stats() and stats["queue_depth"] == 0 and stats["running"] == 0
        assert stats["engine"]["computed_tokens"] > 0
        llm.ready = False   # the serve command sets this until its warm-up is done
        status, ready = await admin.get("/readyz")
        assert status == 503 and ready["checks"]["engine"] is False
        llm.ready = True
        assert (await admin.get("/readyz"))[0] == 200
        await admin.post("/v1/pin", {"tokens": ids, "ttl_s": 5})
        await admin.post("/v1/evict", {"tokens": ids, "to": "cold"})
        await admin.post("/v1/lookup", {"text": SECRET_TEXT + "\ud800"})
    logged = caplog.text
    assert "/v1/lookup" in logged   # the access log is on...
    assert "zebra" not in logged
    assert ", ".join(map(str, ids[:6])) not in logged and ",".join(map(str, ids[:6])) not in logged
