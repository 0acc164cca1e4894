"""The Mooncake Store backend against a real mooncake_master: values come back byte-exact (pages
of 700 KiB, and a value larger than any before), a key the store does not hold reads as None,
exists and delete (a key just read too), a put overwrites, a killed or hung master gives
RemoteDown within timeout_s + 2 s and the restarted or woken one is used again; a bad URL, a
master that is not running and, without the package, any URL are refused; the thread that
waits in the library runs at the lowest priority."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

import mooncakeutil
from conftest import clean_env, requires
from kvstore.errors import ConfigError
from kvstore.remote.backend import REMOTE_BACKENDS, RemoteDown
from kvstore.remote.mooncake import parse_url

needs = (not mooncakeutil.missing(), mooncakeutil.missing())
pytestmark = pytest.mark.usefixtures("requires_part")

PAGE = 700 * 1024
TIMEOUT_S = 1.0


@pytest.fixture
def backend(mooncake_master):
    b = REMOTE_BACKENDS.get("mooncake")(mooncake_master.url, TIMEOUT_S)
    yield b
    b.close()


def pages(n: int, tag: str = "p") -> list[tuple[str, bytes]]:
    return [(f"kvstore:{tag}{i}", os.urandom(PAGE)) for i in range(n)]


def test_values_come_back_byte_exact(backend):
    items = pages(20)
    backend.put_many(items)
    got = backend.get_many([k for k, _ in items])
    assert [bytes(v) for v in got] == [v for _, v in items]
    big = ("kvstore:big", os.urandom(3 << 20))
    backend.put_many([big])
    got = backend.get_many([items[0][0], big[0]])
    assert bytes(got[0]) == items[0][1] and bytes(got[1]) == big[1]


def test_missing_keys_read_as_none(backend):
    items = pages(2)
    backend.put_many(items)
    got = backend.get_many(["kvstore:never", items[1][0], "kvstore:nor-this"])
    assert got[0] is None and got[2] is None and bytes(got[1]) == items[1][1]
    assert backend.get_many(["kvstore:never"]) == [None]
    assert backend.get_many([]) == []


def test_exists_and_delete(backend):
    items = pages(3)
    backend.put_many(items)
    keys = [k for k, _ in items]
    assert backend.exists_many([*keys, "kvstore:never"]) == [True, True, True, False]
    backend.get_many(keys[:1])
    backend.delete_many([keys[0], keys[1], "kvstore:never"])
    assert backend.exists_many(keys) == [False, False, True]
    assert backend.get_many(keys[:2]) == [None, None]
    backend.ping()


def test_put_overwrites(backend):
    backend.put_many([("kvstore:k", b"first" * 1000)])
    backend.put_many([("kvstore:k", b"second" * 1000)])
    assert bytes(backend.get_many(["kvstore:k"])[0]) == b"second" * 1000


def wait_until_answered(call, within_s: float = 20):
    deadline = time.monotonic() + within_s
    while True:
        try:
            return call()
        except RemoteDown:
            assert time.monotonic() < deadline
            time.sleep(0.2)


def test_killed_master_gives_remote_down_in_time_and_a_restarted_one_is_used(backend, mooncake_master):
    items = pages(4)
    backend.put_many(items)
    mooncake_master.kill()
    for call in (lambda: backend.get_many([k for k, _ in items]), lambda: backend.put_many(pages(2, "q")),
                 lambda: backend.exists_many(["kvstore:p0"]), backend.ping):
        start = time.monotonic()
        with pytest.raises(RemoteDown) as exc:
            call()
        assert time.monotonic() - start < TIMEOUT_S + 2
        assert "\n" not in str(exc.value)
    mooncake_master.start()
    wait_until_answered(lambda: backend.put_many([("kvstore:again", b"x" * 4096)]))
    assert bytes(backend.get_many(["kvstore:again"])[0]) == b"x" * 4096
    assert backend.get_many([items[0][0]]) == [None]   # a new master knows no key


def test_hung_master_gives_remote_down_then_recovers(backend, mooncake_master):
    items = pages(2)
    backend.put_many(items)
    mooncake_master.freeze()
    start = time.monotonic()
    with pytest.raises(RemoteDown, match="did not answer"):
        backend.get_many([k for k, _ in items])
    with pytest.raises(RemoteDown, match="has not answered an earlier"):
        backend.exists_many(["kvstore:p0"])
    assert time.monotonic() - start < 2 * TIMEOUT_S + 2
    mooncake_master.thaw()
    got = wait_until_answered(lambda: backend.get_many([k for k, _ in items]))
    assert [bytes(v) for v in got] == [v for _, v in items]


@pytest.mark.parametrize("url", [
    "mooncake://127.0.0.1?metadata=http://127.0.0.1:8080/metadata",
    "mooncake://127.0.0.1:50051",
    "mooncake://127.0.0.1:50051?metadata=ftp://x",
    "mooncake://127.0.0.1:50051?metadata=P2PHANDSHAKE&segment=lots",
    "mooncake://127.0.0.1:50051?metadata=P2PHANDSHAKE&protocol=udp",
    "mooncake://127.0.0.1:50051?metadata=P2PHANDSHAKE&colour=blue",
    "redis://127.0.0.1:6379",
])
def test_bad_url_is_a_config_error(url):
    with pytest.raises(ConfigError) as exc:
        REMOTE_BACKENDS.get("mooncake")(url, TIMEOUT_S)
    assert exc.value.key == "remote.url" and "mooncake://MASTER_HOST:PORT" in str(exc.value)


def test_url_options_and_defaults():
    cfg = parse_url("mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:8080/metadata&segment=1GiB&buffer=16MiB")
    assert cfg == {"local": "127.0.0.1", "metadata": "http://127.0.0.1:8080/metadata", "segment": 1 << 30,
                   "buffer": 16 << 20, "protocol": "tcp", "device": "", "master": "127.0.0.1:50051"}
    assert parse_url("mooncake://10.0.0.5:1?metadata=P2PHANDSHAKE&local=10.0.0.9")["local"] == "10.0.0.9"


def test_master_not_running_gives_remote_down(tmp_path):
    port = mooncakeutil.free_port()
    start = time.monotonic()
    with pytest.raises(RemoteDown, match="master at 127.0.0.1:.* cannot be reached"):
        REMOTE_BACKENDS.get("mooncake")(f"mooncake://127.0.0.1:{port}?metadata=http://127.0.0.1:{port}/metadata",
                                        TIMEOUT_S)
    assert time.monotonic() - start < TIMEOUT_S + 2


def test_without_the_package_the_url_is_a_config_error():
    code = ("import sys; sys.modules['mooncake'] = sys.modules['mooncake.store'] = None\n"
            "from kvstore.remote.backend import REMOTE_BACKENDS\nimport kvstore.remote.mooncake\n"
            "from kvstore.errors import ConfigError\n"
            "try:\n    REMOTE_BACKENDS.get('mooncake')('mooncake://127.0.0.1:1?metadata=P2PHANDSHAKE', 1.0)\n"
            "except ConfigError as exc:\n    print(exc.key, exc.allowed)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=60)
    assert out.stdout.startswith("remote.url mooncake:// needs the package mooncake-transfer-engine-non-cuda"), out


def test_the_helper_thread_keeps_the_process_priority(backend):
    """The library busy-waits on the thread that calls it, and the next read starts only once that
    wait has ended: the thread keeps the process's nice value, as a lower priority starves the wait
    (and every read after it) on a machine whose cores are busy."""
    requires(sys.platform.startswith("linux"), "a thread's own nice value is Linux's")
    backend.put_many(pages(1))
    assert backend.get_many(["kvstore:p0"])[0] is not None
    helpers = [t for t in threading.enumerate() if t.name == "kvstore-mooncake" and t.is_alive()]
    assert helpers
    for t in helpers:
        assert os.getpriority(os.PRIO_PROCESS, t.native_id) == os.getpriority(os.PRIO_PROCESS, 0)
