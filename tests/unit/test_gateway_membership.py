"""Membership events applied to a running gateway (one process, fake replicas behind
``httpx.MockTransport``); the admin API; reload; scale from zero. Real sockets, emulator
replicas and dnsmasq are in tests/integration/test_gateway_fleet_changes.py."""

import asyncio

from prefixroute.core.clock import MonotonicClock
from prefixroute.core.routing.lifecycle import DRAINING, UP
from prefixroute.edges.discovery.events import (ADDED, REMOVED, RESET, Member,
                                                MembershipEvent)
from prefixroute.edges.gateway.admission import AdmissionQueue
from prefixroute.edges.gateway.config import BackendConfig, hash_api_key
from tests.unit.test_gateway_app import FakeReplica, Harness, make_config, run

ADMIN = {"authorization": "Bearer key-ops"}
ALICE = {"authorization": "Bearer key-alice"}


class GatedReplica(FakeReplica):
    """Holds every completion until ``gate`` opens."""

    def __init__(self, name):
        super().__init__(name)
        self.gate = asyncio.Event()
        self.arrived = 0

    async def handle(self, request):
        if request.url.path.startswith("/v1/"):
            if request.method == "POST":
                self.arrived += 1
                await self.gate.wait()
        return await super().handle(request)


def added(name, host=None, source="file:test"):
    return MembershipEvent(ADDED, name, Member(BackendConfig(
        name, f"http://{host or name}.test", ("tiny",))), source)


async def complete(h, prompt="hello there", headers=ALICE):
    return await h.http.post("/v1/completions", headers=headers,
                             json={"model": "tiny", "prompt": prompt, "max_tokens": 2})


def test_an_added_replica_is_probed_and_becomes_a_cold_candidate(monkeypatch):
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            h.replicas["r2.test"] = FakeReplica("r2")
            await h.gateway.fleet.apply(added("r2"))
            backend = h.gateway.fleet.entries["r2"].backend
            assert backend.index == 2 and backend in h.gateway.pool.backends
            assert h.gateway.router.runner.states[2] == UP
            assert len(backend.view) == 0  # starts cold
            await h.gateway.fleet.drain("r0")
            await h.gateway.fleet.drain("r1")
            assert (await complete(h)).status_code == 200
            assert len(h.r("r2").bodies) == 1
    run(scenario())


def test_a_name_held_by_another_source_is_not_taken_over(monkeypatch):
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            await h.gateway.fleet.apply(added("r0", host="elsewhere"))
            assert h.gateway.fleet.entries["r0"].source == "config"
            assert h.gateway.fleet.entries["r0"].backend.url == "http://r0.test"
    run(scenario())


def test_a_removed_replica_finishes_its_requests_then_its_state_goes(monkeypatch):
    async def scenario():
        async with Harness(make_config(monkeypatch, policy="round_robin")) as h:
            fleet = h.gateway.fleet
            gated = h.replicas["r2.test"] = GatedReplica("r2")
            await fleet.apply(added("r2"))
            await fleet.drain("r0")
            await fleet.drain("r1")
            pending = asyncio.create_task(complete(h))
            while gated.arrived == 0:
                await asyncio.sleep(0.01)
            await fleet.apply(MembershipEvent(REMOVED, "r2", None, "file:test"))
            await fleet.reap()
            assert [b["state"] for b in fleet.describe() if b["name"] == "r2"] == ["leaving"]
            assert 2 in h.gateway.router.runner.replicas  # still there for its booking
            await fleet.undrain("r0")
            assert (await complete(h, "another")).status_code == 200
            assert gated.arrived == 1  # no new request on the leaving replica
            gated.gate.set()
            assert (await pending).status_code == 200
            await fleet.reap()
            assert not fleet.leaving and 2 not in h.gateway.router.runner.states
            assert all(b["name"] != "r2" for b in fleet.describe())
    run(scenario())


def test_a_reset_event_empties_the_routers_view_of_the_replica(monkeypatch):
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            await complete(h, "a prompt long enough to fill some blocks " * 4)
            backend = next(b for b in h.gateway.pool.backends if b.view and len(b.view))
            await h.gateway.fleet.apply(MembershipEvent(RESET, backend.name, None, "config"))
            assert len(backend.view) == 0
    run(scenario())


# -- the admin API ------------------------------------------------------------------------

def test_admin_api_is_for_admin_tenants_only(monkeypatch):
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            assert (await h.http.get("/admin/backends")).status_code == 401
            response = await h.http.post("/admin/backends/r0/drain", headers=ALICE)
            assert response.status_code == 403
            assert response.json()["error"]["code"] == "permission_denied"
            assert (await h.http.post("/admin/reload", headers=ALICE)).status_code == 403
            response = await h.http.post("/admin/backends/nope/drain", headers=ADMIN)
            assert response.status_code == 404
            assert response.json()["error"]["code"] == "backend_not_found"
    run(scenario())


def test_drain_stops_new_requests_and_undrain_brings_them_back(monkeypatch):
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            response = await h.http.post("/admin/backends/r1/drain?wait_s=1", headers=ADMIN)
            assert response.json() == {"name": "r1", "state": "drained", "in_flight": 0,
                                       "drained": True}
            assert h.gateway.router.runner.states[1] == DRAINING
            for i in range(6):
                assert (await complete(h, f"prompt {i}")).status_code == 200
            assert len(h.r("r1").bodies) == 0 and len(h.r("r0").bodies) == 6
            listed = (await h.http.get("/admin/backends", headers=ADMIN)).json()["data"]
            assert {b["name"]: b["state"] for b in listed} == {"r0": "up", "r1": "drained"}
            response = await h.http.post("/admin/backends/r1/undrain", headers=ADMIN)
            assert response.json() == {"name": "r1", "state": "up"}
            await h.gateway.fleet.drain("r0")
            assert (await complete(h, "after")).status_code == 200
            assert len(h.r("r1").bodies) == 1
    run(scenario())


def test_an_admin_drain_outlives_the_source_listing_the_replica_again(monkeypatch):
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            h.replicas["r2.test"] = FakeReplica("r2")
            fleet = h.gateway.fleet
            await fleet.apply(added("r2"))
            await fleet.drain("r2")
            await fleet.apply(MembershipEvent(REMOVED, "r2", None, "file:test"))
            await fleet.reap()
            await fleet.apply(added("r2"))
            assert fleet.state_of(fleet.entries["r2"]) == "drained"
            await fleet.undrain("r2")
            assert fleet.state_of(fleet.entries["r2"]) == "up"
    run(scenario())


# -- reload ---------------------------------------------------------------------------------

def write_config(path, monkeypatch, **extra):
    import yaml

    config = make_config(monkeypatch, **extra)  # validates the same data
    data = {
        "server_secret": {"env": "PR_GATEWAY_TEST_SECRET"},
        "backends": [{"name": b.name, "url": b.url, "models": list(b.models)}
                     for b in config.backends],
        "tenants": [{"name": t.name, "api_keys_sha256": list(t.api_key_hashes),
                     "trust_group": t.trust_group, "admin": t.admin} for t in config.tenants],
        "hashing": {"block_size": config.hashing.block_size},
        "policy": config.policy,
        "health": {"interval_s": 60, "metrics_interval_s": 60},
        **extra,
    }
    path.write_text(yaml.safe_dump(data))
    return data


def started_from_file(path, monkeypatch):
    from prefixroute.edges.gateway.config import load_config

    write_config(path, monkeypatch)
    return load_config(path)


def test_reload_adds_a_tenant_key_that_works_at_once(monkeypatch, tmp_path):
    async def scenario():
        path = tmp_path / "gateway.yaml"
        async with Harness(started_from_file(path, monkeypatch)) as h:
            carol = {"authorization": "Bearer key-carol"}
            assert (await complete(h, headers=carol)).status_code == 401
            tenants = make_config(monkeypatch).tenants
            write_config(path, monkeypatch, tenants=[
                *[{"name": t.name, "api_keys_sha256": list(t.api_key_hashes),
                   "trust_group": t.trust_group, "admin": t.admin} for t in tenants],
                {"name": "carol", "api_key_sha256": hash_api_key("key-carol")}],
                policy="least_loaded", limits={"max_concurrent": 3})
            response = await h.http.post("/admin/reload", headers=ADMIN)
            assert response.status_code == 200, response.text
            assert set(response.json()["changed"]) == {"tenants", "policy", "limits"}
            assert (await complete(h, headers=carol)).status_code == 200
            assert h.gateway.router.policy_name == "least_loaded"
            assert h.gateway.admission.max_concurrent == 3
    run(scenario())


def test_an_invalid_reload_is_refused_with_the_reason_and_the_old_config_stays(
        monkeypatch, tmp_path):
    async def scenario():
        path = tmp_path / "gateway.yaml"
        async with Harness(started_from_file(path, monkeypatch)) as h:
            before = h.gateway.config
            data = write_config(path, monkeypatch)
            data["tenants"][0]["api_key_sha256"] = "not-a-digest"
            import yaml
            path.write_text(yaml.safe_dump(data))
            response = await h.http.post("/admin/reload", headers=ADMIN)
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["code"] == "invalid_config"
            assert "gateway.yaml" in error["message"] and "tenants[0]" in error["message"]
            write_config(path, monkeypatch, hashing={"block_size": 32})
            response = await h.http.post("/admin/reload", headers=ADMIN)
            assert response.status_code == 400
            assert "'hashing' cannot change" in response.json()["error"]["message"]
            assert h.gateway.config is before
            assert (await complete(h)).status_code == 200
    run(scenario())


def test_reload_applies_backend_changes_as_membership_events(monkeypatch, tmp_path):
    async def scenario():
        path = tmp_path / "gateway.yaml"
        async with Harness(started_from_file(path, monkeypatch)) as h:
            h.replicas["r2.test"] = FakeReplica("r2")
            write_config(path, monkeypatch, backends=[
                {"name": "r0", "url": "http://r0.test", "models": ["tiny"]},
                {"name": "r2", "url": "http://r2.test", "models": ["tiny"]}])
            assert (await h.http.post("/admin/reload", headers=ADMIN)).status_code == 200
            await h.gateway.fleet.reap()
            assert sorted(b.name for b in h.gateway.pool.backends) == ["r0", "r2"]
            assert h.gateway.fleet.entries["r0"].backend.index == 0  # unchanged: kept
    run(scenario())


# -- scale from zero ------------------------------------------------------------------------

def test_with_no_replica_a_request_waits_for_one_to_join(monkeypatch, tmp_path):
    async def scenario():
        members = tmp_path / "members.yaml"
        members.write_text("")
        config = make_config(monkeypatch, backends=[], limits={"queue_timeout_s": 10},
                             discovery={"file": str(members), "file_interval_s": 0.05},
                             backend_defaults={"models": ["tiny"]})
        async with Harness(config, clock=MonotonicClock()) as h:
            pending = asyncio.create_task(complete(h))
            await asyncio.sleep(0.3)
            assert not pending.done()
            members.write_text("- {name: r0, url: 'http://r0.test'}\n")
            response = await asyncio.wait_for(pending, 5)
            assert response.status_code == 200
            assert len(h.r("r0").bodies) == 1
    run(scenario())


def test_with_no_replica_after_queue_timeout_a_clear_503(monkeypatch, tmp_path):
    async def scenario():
        members = tmp_path / "members.yaml"
        members.write_text("")
        config = make_config(monkeypatch, backends=[], limits={"queue_timeout_s": 0.3},
                             discovery={"file": str(members)},
                             backend_defaults={"models": ["tiny"]})
        async with Harness(config, clock=MonotonicClock()) as h:
            response = await complete(h)
            assert response.status_code == 503
            error = response.json()["error"]
            assert error["code"] == "no_replica_available"
            assert "waited 0.3 s" in error["message"]
            assert response.headers["retry-after"] == "1"
            # A model nothing could serve is still a 404 at once.
            response = await h.http.post("/v1/completions", headers=ALICE,
                                         json={"model": "typo", "prompt": "x"})
            assert response.status_code == 404
    run(scenario())


# -- the admission queue ------------------------------------------------------------------

def test_admission_resize_frees_or_takes_back_slots_without_dropping_anyone():
    async def scenario():
        queue = AdmissionQueue(2, 10, 5.0)
        await queue.acquire()
        await queue.acquire()
        waiter = asyncio.create_task(queue.acquire())
        await asyncio.sleep(0)
        assert not waiter.done()
        await queue.resize(3, 10, 5.0)
        await asyncio.wait_for(waiter, 1)  # the new slot goes to the waiting request
        await queue.resize(1, 10, 5.0)  # 3 active: two slots come back as they end
        queue.release()
        queue.release()
        late = asyncio.create_task(queue.acquire())
        await asyncio.sleep(0.01)
        assert not late.done()  # one active, limit one
        queue.release()
        await asyncio.wait_for(late, 1)
        assert queue.active == 1
    run(scenario())


def test_a_reload_keeps_the_bucket_of_a_tenant_whose_limit_did_not_change():
    from prefixroute.core.clock import ManualClock
    from prefixroute.edges.gateway.config import RateLimit, TenantConfig
    from prefixroute.edges.gateway.tenants import TenantRegistry

    clock = ManualClock()
    same = TenantConfig("a", (hash_api_key("ka"),), "a", RateLimit(1.0, 2))
    changed = TenantConfig("b", (hash_api_key("kb"),), "b", RateLimit(1.0, 2))
    old = TenantRegistry((same, changed), b"s" * 32, clock)
    for tenant in old.tenants:
        tenant.bucket.try_take()
        tenant.bucket.try_take()  # both buckets empty
    new = TenantRegistry((same, TenantConfig("b", changed.api_key_hashes, "b",
                                             RateLimit(1.0, 5))), b"s" * 32, clock,
                         previous=old)
    assert new.tenants[0].bucket is old.tenants[0].bucket
    assert new.tenants[0].bucket.try_take() > 0  # still empty: a reload refills nothing
    assert new.tenants[1].bucket.try_take() == 0.0  # a new limit starts a new bucket


def test_an_added_replica_that_does_not_answer_stays_out_of_rotation(monkeypatch):
    async def scenario():
        async with Harness(make_config(monkeypatch)) as h:
            dead = h.replicas["r2.test"] = FakeReplica("r2")
            dead.fault = "connect"
            await h.gateway.fleet.apply(added("r2"))
            backend = h.gateway.fleet.entries["r2"].backend
            assert not backend.available()
            for i in range(4):
                assert (await complete(h, f"q{i}")).status_code == 200
            assert dead.bodies == []
    run(scenario())


def test_reload_to_another_membership_file_swaps_its_replicas(monkeypatch, tmp_path):
    async def scenario():
        path = tmp_path / "gateway.yaml"
        first, second = tmp_path / "one.yaml", tmp_path / "two.yaml"
        first.write_text("- {name: r2, url: 'http://r2.test'}\n")
        second.write_text("- {name: r2, url: 'http://r2.test'}\n"
                          "- {name: r3, url: 'http://r3.test'}\n")
        write_config(path, monkeypatch, discovery={"file": str(first)},
                     backend_defaults={"models": ["tiny"]})
        from prefixroute.edges.gateway.config import load_config
        h = Harness(load_config(path))
        h.replicas["r2.test"] = FakeReplica("r2")
        h.replicas["r3.test"] = FakeReplica("r3")
        async with h:
            fleet = h.gateway.fleet
            assert fleet.entries["r2"].source == f"file:{first}"
            index = fleet.entries["r2"].backend.index
            write_config(path, monkeypatch, discovery={"file": str(second)},
                         backend_defaults={"models": ["tiny"]})
            assert (await h.http.post("/admin/reload", headers=ADMIN)).status_code == 200
            await fleet.reap()
            assert {n: e.source for n, e in fleet.entries.items()} == {
                "r0": "config", "r1": "config", "r2": f"file:{second}",
                "r3": f"file:{second}"}
            assert fleet.entries["r2"].backend.index != index  # it left and joined again
    run(scenario())
