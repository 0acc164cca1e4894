"""A hypothesis state machine over two real stores sharing one real redis-server as their remote tier.

Store A and store B (each its own data directory, tiny hot, warm and cold tiers) compute documents
that share their first page, write them behind to cold and to the remote, evict them, and fetch
from the remote what they do not hold, in random order; meanwhile values in Redis are damaged
(a flipped byte, cut short, another page's record under the key, deleted) and the server is
restarted empty. After every step, in both stores, every page held in hot or warm has exactly the
bytes its key was computed with (a damaged or foreign value is never served) and the audit finds
nothing; a fetch never raises, whatever the server holds or whether it is up.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid

import pytest
import redis
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstore.pages import record
from kvstore.pages.keys import page_keys, page_tokens
from kvstore.pages.record import RecordHeader
from redisutil import RedisServer
from storeutil import SPEC, expected_page, fill_and_commit, make_store, settle

PS = SPEC.page_size
# Documents of 3 pages; 0-1 and 2-3 share their first page.
DOCS = [[((d // 2) * 41 + i * 5 + t) % 500 if i == 0 else (d * 37 + i * 11 + t) % 500
         for i in range(3) for t in range(PS)] for d in range(4)]
STORES = ("a", "b")
_server: RedisServer | None = None


@pytest.fixture(scope="module", autouse=True)
def server(tmp_path_factory):
    global _server
    _server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield _server
    _server.stop()
    _server = None


def flipped(value: bytes) -> bytes:
    """value with its middle byte inverted."""
    i = len(value) // 2
    return value[:i] + bytes([value[i] ^ 0xFF]) + value[i + 1:]


class RemoteMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvstore-rm-")
        self.prefix = f"rm{uuid.uuid4().hex[:8]}:"
        self.stores = {}
        self.client = redis.Redis(host="127.0.0.1", port=_server.port)

    @initialize()
    def open(self):
        for name in STORES:
            self.stores[name] = make_store(f"{self.dir}/{name}", hot=6, warm=4, cold=8,
                                           **{"remote.url": _server.url, "remote.key_prefix": self.prefix,
                                              "remote.timeout_ms": "500"})
        self.ns = self.stores["a"].namespace()

    def keys(self, doc: int) -> list[bytes]:
        return page_keys(self.ns, DOCS[doc], PS)

    def remote_key(self, key: bytes) -> str:
        return self.stores["a"].remote.key(self.ns.digest, key)

    @rule(name=st.sampled_from(STORES), doc=st.integers(0, 3), share=st.booleans())
    def compute(self, name, doc, share):
        """Compute a document; with `share`, wait until write-behind has sent it to cold and the remote."""
        store = self.stores[name]
        slots, _ = fill_and_commit(store, self.ns, DOCS[doc])
        store.release(slots)
        if share:
            settle(store)
            store.remote.wait_written(2 if store.remote.available() else 0)

    @rule(name=st.sampled_from(STORES), doc=st.integers(0, 3), to=st.sampled_from(["warm", "cold", None]))
    def evict(self, name, doc, to):
        store = self.stores[name]
        store.evict(store.match(DOCS[doc], self.ns).keys, to=to)

    @rule(name=st.sampled_from(STORES), doc=st.integers(0, 3))
    def fetch(self, name, doc):
        local, added = self.stores[name].fetch_remote(DOCS[doc], self.ns)
        assert 0 <= local and 0 <= added and local + added <= len(DOCS[doc]) // PS

    def intact(self, doc: int, page: int) -> bytes:
        """The record a store writes for page `page` of document `doc` (its content depends only on its key)."""
        keys, tokens = self.keys(doc), page_tokens(DOCS[doc], PS)
        header = RecordHeader(keys[page], keys[page - 1] if page else self.ns.digest, self.ns.digest,
                              tokens[page], SPEC.fingerprint, SPEC.page_bytes)
        return record.encode_bytes(header, expected_page(keys[page]).numpy().tobytes())

    @rule(name=st.sampled_from(STORES), doc=st.integers(0, 3), page=st.integers(0, 2),
          how=st.sampled_from(["flip", "foreign"]))
    def fetch_past_damage(self, name, doc, page, how):
        """A store that dropped a document fetches it while one of its values is damaged (a flipped
        byte) or is another page's intact record: the fetch stops before that page."""
        store, remote = self.stores[name], self.remote_key(self.keys(doc)[page])
        if how == "flip":
            planted = flipped(self.intact(doc, page))
        else:
            planted = self.intact(doc, (page + 1) % 3)
        self.client.set(remote, planted)
        store.evict(store.match(DOCS[doc], self.ns).keys, to=None)
        local, added = store.fetch_remote(DOCS[doc], self.ns)
        if local <= page and self.client.get(remote) == planted:   # what it read was the planted value
            assert local + added <= page, f"fetched {local}+{added} pages past a {how} value at page {page}"

    @rule(doc=st.integers(0, 3), page=st.integers(0, 2),
          how=st.sampled_from(["flip", "cut", "foreign", "delete", "restart"]))
    def damage(self, doc, page, how):
        """A value in Redis damaged, replaced by another page's record or deleted, or the server restarted
        empty (no persistence): what a store then fetches must still be exact."""
        if how == "restart":
            _server.stop()
            for store in self.stores.values():   # the server down: misses, never an error
                for tokens in DOCS:
                    store.fetch_remote(tokens, self.ns)
            _server.start()
            deadline = time.monotonic() + 1      # a store that saw it down retries after its backoff (from
            while not all(s.remote.available() for s in self.stores.values()) and time.monotonic() < deadline:
                time.sleep(0.05)                 # 0.5 s, doubling while it stays down): up to a second here
            return
        keys = self.keys(doc)
        name = self.remote_key(keys[page])
        value = self.client.get(name)
        if value is None:
            return
        if how == "flip":
            self.client.set(name, flipped(value))
        elif how == "cut":
            self.client.set(name, value[:len(value) // 3])
        elif how == "foreign":
            other = self.client.get(self.remote_key(keys[(page + 1) % len(keys)]))
            if other is not None:
                self.client.set(name, other)
        else:
            self.client.delete(name)

    @invariant()
    def served_pages_are_exact(self):
        for name, store in self.stores.items():
            with store.core.lock:
                held = [(e.key, e.hot, e.warm) for e in store.index.entries.values()]
                for key, hot, warm in held:
                    want = expected_page(key).numpy().tobytes()
                    if hot is not None:
                        assert bytes(store.hot.payloads([hot])[0]) == want, f"store {name}: hot page {key.hex()[:8]}"
                    if warm is not None:
                        assert bytes(store.warm.payloads([warm])[0]) == want, f"store {name}: warm page {key.hex()[:8]}"
            assert store.audit(cold=False)["problems"] == []

    def teardown(self):
        try:
            for store in self.stores.values():
                assert store.audit()["problems"] == []
        finally:
            for store in self.stores.values():
                store.close()
            self.client.close()
            shutil.rmtree(self.dir, ignore_errors=True)


RemoteMachine.TestCase.settings = settings(max_examples=20, stateful_step_count=30, deadline=None,
                                           suppress_health_check=list(HealthCheck))
TestRemoteMachine = pytest.mark.timeout(900)(RemoteMachine.TestCase)
