"""The state bus's servers as pytest parameters: a test over ``BUS_SERVERS`` runs once on a
real redis-server and once on a real nats-server, each skipped where its binary is missing
(``make redis``, ``make nats``)."""

from __future__ import annotations

import pytest
from nats_server import NATS_SERVER, NatsServer
from redis_server import REDIS_SERVER, RedisServer

BusServer = RedisServer | NatsServer

BUS_SERVERS = [
    pytest.param(
        RedisServer,
        id="redis",
        marks=pytest.mark.skipif(REDIS_SERVER is None, reason="no redis-server (make redis)"),
    ),
    pytest.param(
        NatsServer,
        id="nats",
        marks=pytest.mark.skipif(NATS_SERVER is None, reason="no nats-server (make nats)"),
    ),
]
