"""Namespaces and hash-chained page keys.

key_i = blake3(namespace digest || key_{i-1} || token ids of page i as little-endian int32),
with key_{-1} = the namespace digest. Only full pages get keys. blake3 makes keys identical
across processes and machines (no PYTHONHASHSEED) and crafted collisions infeasible.

Named pages: an engine that names its pages itself (SGLang's HiCache: a hash of the whole prefix
up to the page) stores each as a root page whose "tokens" are a digest of its name, so its key is
the chain hash of (namespace, namespace, digest) and a record still proves its own key.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import blake3
import numpy as np

from kvstore.pages.spec import LAYOUT_VERSION, KVSpec

KEY_BYTES = 32


@dataclass(frozen=True)
class Namespace:
    """Everything a page's bytes depend on besides its tokens, plus who may see it.

    A page is served only to a request with the same namespace: the same model identity,
    KV dtype and layout (geometry included), and the same tenant and cache salt.
    """

    model: str
    kv_dtype: str
    layout: str = LAYOUT_VERSION
    tenant: str = ""
    salt: str = ""

    @classmethod
    def for_spec(cls, model: str, spec: KVSpec, tenant: str = "", salt: str = "",
                 layout: str = "") -> "Namespace":
        """`layout` names a client's own byte layout of a page (e.g. another engine's KV blocks,
        stored as opaque bytes); empty means kvstore's page-first layout."""
        return cls(model=model, kv_dtype=spec.dtype, layout=f"{layout or LAYOUT_VERSION}/{spec.fingerprint.hex()}",
                   tenant=tenant, salt=salt)

    def with_tenant(self, tenant: str) -> "Namespace":
        return Namespace(self.model, self.kv_dtype, self.layout, tenant, self.salt)

    @cached_property
    def digest(self) -> bytes:
        h = blake3.blake3(b"kvstore-namespace-v1")
        for part in (self.model, self.kv_dtype, self.layout, self.tenant, self.salt):
            data = part.encode()
            h.update(len(data).to_bytes(4, "little") + data)
        return h.digest(KEY_BYTES)


NAME_MAX = 1024   # characters of a page name


def name_tokens(name: str) -> bytes:
    """The "tokens" of a named page: 32 bytes (8 int32) of a digest of its name."""
    return blake3.blake3(b"kvstore-named-page-v1" + name.encode()).digest(KEY_BYTES)


def named_key(namespace: Namespace, name: str) -> bytes:
    """The key of the page an engine calls `name`, in `namespace` (a root page: its parent is the namespace)."""
    digest = namespace.digest
    return blake3.blake3(digest + digest + name_tokens(name)).digest(KEY_BYTES)


def tokens_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def page_tokens(tokens: Sequence[int], page_size: int, start: int = 0) -> list[bytes]:
    """tokens_bytes of each full page of `tokens` from page `start` on (one conversion for all)."""
    n = len(tokens) // page_size
    if n <= start:
        return []
    data, step = tokens_bytes(tokens[start * page_size:n * page_size]), 4 * page_size
    return [data[i:i + step] for i in range(0, len(data), step)]


def chain_key(namespace_digest: bytes, parent: bytes, page_tokens: Sequence[int]) -> bytes:
    """The key of one page given its parent's key (the namespace digest for page 0)."""
    return chain_key_of_bytes(namespace_digest, parent, tokens_bytes(page_tokens))


def chain_key_of_bytes(namespace_digest: bytes, parent: bytes, token_bytes: bytes) -> bytes:
    """chain_key of a page's tokens already converted (tokens_bytes)."""
    return blake3.blake3(namespace_digest + parent + token_bytes).digest(KEY_BYTES)


def page_keys(namespace: Namespace, tokens: Sequence[int], page_size: int,
              start: int = 0, parent: bytes | None = None) -> list[bytes]:
    """Keys of the full pages of `tokens`, from page `start` on.

    When start > 0, `parent` must be the key of page start-1.
    """
    digest = namespace.digest
    prev = digest if start == 0 else parent
    if prev is None:
        raise ValueError("page_keys: parent key required when start > 0")
    keys = []
    for page in page_tokens(tokens, page_size, start):
        prev = chain_key_of_bytes(digest, prev, page)
        keys.append(prev)
    return keys
