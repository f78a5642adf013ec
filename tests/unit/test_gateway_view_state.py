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


def test_doctor_reads_each_replica_s_view_state_from_the_gateway_s_metrics(monkeypatch):
    from prefixroute.edges.gateway.doctor import WARN, gateway_view_checks, gateway_view_states

    gateway = Gateway(config(monkeypatch, [free_port(), free_port()]),
                      transport=httpx.MockTransport(backend), clock=ManualClock())
    r0, r1 = gateway.pool.backends
    stored = BlockStored((1, 2), None, tuple(range(32)), BLOCK)
    r0.apply_events(received([stored], missing=3))  # r0: 3 batches lost for good
    r1.apply_events(received([stored]))
    r1.apply_events(received([stored], restarted=True))  # r1: the engine restarted
    states = {s.replica: s for s in gateway_view_states(gateway.metrics.render().decode())}
    assert (states["r0"].state, states["r0"].missing, states["r0"].restarts) == ("degraded", 3, 0)
    assert (states["r1"].state, states["r1"].missing, states["r1"].restarts) == ("exact", 0, 1)
    assert states["r1"].blocks == 2
    checks = {c.name: c for c in gateway_view_checks(list(states.values()))}
    assert checks["view r0"].status == WARN and "3 event batches lost" in checks["view r0"].detail
    assert "1 restarts seen" in checks["view r1"].detail
