"""pytest fixtures for tests that share Redis servers within a module: one redis-server, and a
3-master cluster, on free loopback ports (import them into the test module)."""

from __future__ import annotations

import pytest

from redisutil import RedisServer, make_cluster


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    servers = make_cluster(tmp_path_factory.mktemp("cluster"))
    yield servers
    for s in servers:
        s.stop()
