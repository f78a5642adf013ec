"""A replica's event view says whether it is exact: degraded from a KV event batch lost for
good, exact again once the engine starts over (restart or clear)."""

import httpx

from prefixroute.core.clock import ManualClock
from prefixroute.core.kvevents import AllBlocksCleared, BlockStored
from prefixroute.edges.gateway.app import Gateway
from prefixroute.edges.listen import free_port
from tests.unit.test_gateway_kvevents import BLOCK, backend, config, received


def gauge(gateway, replica):
    return gateway.metrics.registry.get_sample_value(
        "prefixroute_gateway_replica_view_exact", {"replica": replica})


def test_a_lost_batch_degrades_the_view_and_a_restart_makes_it_exact_again(monkeypatch):
    gateway = Gateway(config(monkeypatch, [free_port()]), transport=httpx.MockTransport(backend),
                      clock=ManualClock())
    r0 = gateway.pool.backends[0]
    stored = BlockStored((1, 2), None, tuple(range(32)), BLOCK)
    r0.apply_events(received([stored]))
    assert (r0.view_state, gauge(gateway, "r0")) == ("exact", 1)
    r0.apply_events(received([stored], missing=3))  # 3 batches gone, not replayable
    assert (r0.view_state, gauge(gateway, "r0")) == ("degraded", 0)
    assert r0.status()["view_state"] == "degraded"
    r0.apply_events(received([stored]))  # later batches do not repair what was lost
    assert r0.view_state == "degraded"
    r0.apply_events(received([stored], restarted=True))
    assert (r0.view_state, gauge(gateway, "r0")) == ("exact", 1)


def test_a_cleared_cache_makes_a_degraded_view_exact(monkeypatch):
    gateway = Gateway(config(monkeypatch, [free_port()]), transport=httpx.MockTransport(backend),
                      clock=ManualClock())
    r0 = gateway.pool.backends[0]
    r0.apply_events(received([], missing=1))
    assert r0.view_state == "degraded"
    r0.apply_events(received([AllBlocksCleared()]))
    assert r0.view_state == "exact"
