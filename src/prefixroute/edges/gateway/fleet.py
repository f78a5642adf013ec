"""A fleet that changes while it serves: membership events applied to the backend set.

:class:`Fleet` owns the gateway's membership. Its sources (:mod:`prefixroute.edges.discovery`:
the static ``backends`` list, a watched file, DNS) say which replicas exist; the admin API
drains and undrains them. Every change goes through :meth:`Fleet.apply`, one event at a time,
to the two places that know a replica: the :class:`BackendPool` (health checks, breaker,
metrics scrapes, KV event subscriber) and the lifecycle runner (candidates, counts, cache
views, the policy's hooks).

* **added**: a new :class:`Backend` under a fresh index (indices are never reused, so a
  request in flight on an old replica never ends on a new one). It is probed once (health,
  models, metrics) before it becomes a candidate, and starts cold: an empty cache view.
* **draining** (a source's flag, or ``POST /admin/backends/{name}/drain``): no new requests,
  retries included; those in flight finish. A replica drained by the admin API stays out,
  even if its source lists it again, until it is undrained.
* **removed**: drained, and dropped from the runner and the pool (its checks and event
  subscriber stop) once its last request in flight has ended.
* **reset**: the router forgets what it learned of the replica's cache.

Nothing here knows HTTP: the gateway's app and an Endpoint Picker can share it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import httpx

from prefixroute.core.clock import Clock
from prefixroute.edges.discovery.events import (ADDED, DRAINING, REMOVED, RESET, Member,
                                                MembershipEvent, diff_members)
from prefixroute.edges.gateway.backends import Backend, BackendPool
from prefixroute.edges.gateway.config import GatewayConfig
from prefixroute.edges.gateway.metrics import GatewayMetrics

log = logging.getLogger("prefixroute.gateway")

STATIC = "config"
UP, DRAINING_STATE, DRAINED, LEAVING = "up", "draining", "drained", "leaving"
REAP_INTERVAL_S = 0.1  # how soon a removed replica's state goes after its last request


@dataclass(slots=True)
class Entry:
    """One replica of the fleet and why it is in the state it is in."""

    backend: Backend
    member: Member
    source: str
    admin_drained: bool = False

    @property
    def draining(self) -> bool:
        return self.admin_drained or self.member.draining


class UnknownBackend(KeyError):
    """No replica of that name."""


class Fleet:
    """The gateway's replicas as they come and go (module docstring)."""

    def __init__(self, config: GatewayConfig, pool: BackendPool, router: Any, clock: Clock,
                 metrics: GatewayMetrics):
        self.config = config
        self.pool = pool
        self.router = router  # wires each new backend's signals (GatewayRouter.watch)
        self.runner = router.runner
        self.clock = clock
        self.metrics = metrics
        self.entries: dict[str, Entry] = {}
        self.leaving: list[Backend] = []
        self.admin_drained: set[str] = set()  # names, kept while a replica is away
        self.sources: list[Any] = []
        self.client: httpx.AsyncClient | None = None
        self._lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        self._changed: asyncio.Event | None = None
        self.static: dict[str, Member] = {}
        for backend in pool.backends:  # the static list, already in the pool and runner
            member = Member(backend.config)
            self.static[backend.name] = member
            self.entries[backend.name] = Entry(backend, member, STATIC)

    # -- running --------------------------------------------------------------------------

    async def start(self, client: httpx.AsyncClient) -> None:
        """Start the discovery sources (after the pool's first probe of the static list):
        each source's first answer is applied before serving starts, so a gateway with only
        discovered replicas does not open empty."""
        self.client = client
        self._changed = asyncio.Event()
        self.sources = make_sources(self.config)
        for source in self.sources:
            await self._poll(source)
            self._tasks.append(asyncio.create_task(self._watch(source)))
        self._tasks.append(asyncio.create_task(self._reap_loop()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for backend in self.leaving:
            await self.pool.unwatch(backend)

    async def _watch(self, source: Any) -> None:
        while True:
            await asyncio.sleep(source.interval_s)
            try:
                await self._poll(source)
            except Exception as exc:  # a bug of ours must not stop watching
                log.error("membership source failed", exc_info=exc, extra={"fields": {
                    "event": "membership_error", "source": source.name}})

    async def _poll(self, source: Any) -> None:
        for event in await source.poll():
            await self.apply(event)

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            await self.reap()

    async def reap(self) -> None:
        """Drop the state of removed replicas whose last request has ended."""
        for backend in [b for b in self.leaving if b.in_flight == 0]:
            self.leaving.remove(backend)
            self.runner.remove_replica(backend.index)
            await self.pool.unwatch(backend)
            log.info("replica left", extra={"fields": {"event": "replica_left",
                                                       "replica": backend.name}})

    # -- events ---------------------------------------------------------------------------

    async def apply(self, event: MembershipEvent) -> None:
        """Apply one membership event (module docstring), in arrival order."""
        async with self._lock:
            entry = self.entries.get(event.name)
            if entry is not None and entry.source != event.source:
                if event.kind == ADDED and event.member is not None:
                    log.warning("replica name already in the fleet; ignored", extra={
                        "fields": {"event": "membership_conflict", "replica": event.name,
                                   "source": event.source, "owner": entry.source}})
                return
            log.info("membership event", extra={"fields": {
                "event": f"replica_{event.kind}", "replica": event.name,
                "source": event.source}})
            if event.kind == ADDED and event.member is not None:
                if entry is None:
                    await self._add(event.member, event.source)
                else:  # back from a source's draining flag
                    entry.member = event.member
                    self._update(entry)
            elif event.kind == REMOVED and entry is not None:
                self._remove(entry)
            elif event.kind == DRAINING and entry is not None and event.member is not None:
                entry.member = event.member
                self._update(entry)
            elif event.kind == RESET and entry is not None:
                if event.member is not None:
                    entry.member = event.member
                self.runner.reset_replica(entry.backend.index)
                self.metrics.view_blocks.labels(entry.backend.name).set(
                    len(entry.backend.view))
            self._notify()

    async def _add(self, member: Member, source: str) -> None:
        pool = self.pool
        backend = Backend(pool.next_index, member.backend, self.config, self.clock,
                          self.metrics)
        pool.next_index += 1
        self.router.watch(backend)
        backend.loop = asyncio.get_running_loop()
        if member.backend.kv_events is not None:
            self._subscribe(backend)
        if self.client is not None:
            # Out of rotation until a health check passes: a listed address need not be
            # serving yet (a pod's record can precede its readiness, a file can be early).
            backend.healthy = False
            timeout = self.config.timeouts.health_s
            await backend.check_health(self.client, timeout)
            if backend.healthy:
                await backend.scrape_metrics(self.client, timeout)
        entry = Entry(backend, member, source, admin_drained=member.name in self.admin_drained)
        self.entries[member.name] = entry
        self.runner.add_replica(backend.state)
        if entry.draining:
            backend.draining = True
            self.runner.drain_replica(backend.index)
        else:
            pool.backends.append(backend)
        if self.client is not None:
            pool.watch(backend, self.client)

    def _subscribe(self, backend: Backend) -> None:
        from prefixroute.edges.kvevents.zmq import KVEventSubscriber

        events = backend.config.kv_events
        try:
            backend.subscriber = KVEventSubscriber(
                events.endpoint, bind=events.bind, topic=events.topic,
                replay_endpoint=events.replay_endpoint, on_batch=backend.deliver_events,
                skip_unknown_events=True)
            backend.subscriber.start()
        except Exception as exc:  # zmq.ZMQError: the endpoint is taken or bad
            log.error("cannot open the replica's KV event stream; its view learns from "
                      "routing only until it is re-added", extra={"fields": {
                          "event": "kv_events_error", "replica": backend.name,
                          "endpoint": events.endpoint, "error": str(exc)}})

    def _update(self, entry: Entry) -> None:
        """Put the replica in or take it out of routing as its entry says."""
        backend = entry.backend
        if entry.draining and not backend.draining:
            backend.draining = True
            self.runner.drain_replica(backend.index)
            if backend in self.pool.backends:
                self.pool.backends.remove(backend)
        elif not entry.draining and backend.draining:
            backend.draining = False
            self.runner.add_replica(backend.state)
            if backend not in self.pool.backends:
                self.pool.backends.append(backend)

    def _remove(self, entry: Entry) -> None:
        backend = entry.backend
        del self.entries[backend.name]
        backend.draining = True
        self.runner.drain_replica(backend.index)
        if backend in self.pool.backends:
            self.pool.backends.remove(backend)
        if backend.subscriber is not None:
            # Its events no longer matter (it takes no request), and a replica that comes
            # back under the same name may need the endpoint.
            backend.subscriber.stop()
            backend.subscriber = None
        self.leaving.append(backend)

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    # -- the admin API's verbs ------------------------------------------------------------

    async def drain(self, name: str) -> Entry:
        """No new requests for ``name``; those in flight finish. A discovered replica stays
        out until :meth:`undrain`, even if its source lists it again."""
        async with self._lock:
            entry = self._entry(name)
            entry.admin_drained = True
            self.admin_drained.add(name)
            self._update(entry)
        log.info("replica draining", extra={"fields": {"event": "replica_draining",
                                                       "replica": name, "source": "admin"}})
        return entry

    async def undrain(self, name: str) -> Entry:
        async with self._lock:
            self.admin_drained.discard(name)
            entry = self._entry(name)
            entry.admin_drained = False
            self._update(entry)
            self._notify()
        log.info("replica undrained", extra={"fields": {"event": "replica_undrained",
                                                        "replica": name}})
        return entry

    def _entry(self, name: str) -> Entry:
        entry = self.entries.get(name)
        if entry is None:
            raise UnknownBackend(name)
        return entry

    async def wait_drained(self, name: str, timeout: float) -> bool:
        """Wait until ``name`` has no request in flight (True), or ``timeout`` passes."""
        deadline = self.clock.now() + timeout
        while True:
            entry = self.entries.get(name)
            if entry is None or entry.backend.in_flight == 0:
                return True
            if self.clock.now() >= deadline:
                return False
            await asyncio.sleep(0.05)

    def state_of(self, entry: Entry) -> str:
        if not entry.draining:
            return UP
        return DRAINED if entry.backend.in_flight == 0 else DRAINING_STATE

    def describe(self) -> list[dict[str, Any]]:
        """Every replica (up, draining, drained, leaving) for ``GET /admin/backends``."""
        out = []
        for entry in self.entries.values():
            status = entry.backend.status()
            status.update({"state": self.state_of(entry), "source": entry.source,
                           "drained_by_admin": entry.admin_drained,
                           "generation": entry.member.generation,
                           "assignments": entry.backend.assignments})
            out.append(status)
        for backend in self.leaving:
            status = backend.status()
            status.update({"state": LEAVING, "source": None, "drained_by_admin": False})
            out.append(status)
        return out

    # -- scale from zero ------------------------------------------------------------------

    def may_appear(self, model: str) -> bool:
        """Whether a replica for ``model`` may join (worth waiting for): a replica that
        serves it is draining or away, ``backend_defaults`` names it, or discovery runs
        without ``backend_defaults.models`` and no replica has told its models yet
        (nothing to tell a model from a typo)."""
        listed = set(self.config.backend_defaults.get("models") or [])
        for entry in self.entries.values():
            if model in entry.backend.models or model in entry.member.backend.models:
                return True
        if model in listed:
            return True
        for backend in self.leaving:
            if model in backend.models:
                return True
        if self.config.discovery is not None and not listed:
            # Discovered replicas tell their models when they join.
            return not any(entry.backend.models for entry in self.entries.values())
        return False

    async def wait_for(self, model: str, timeout: float) -> list[Backend]:
        """The replicas serving ``model`` once at least one is a candidate, or [] after
        ``timeout`` seconds."""
        deadline = self.clock.now() + timeout
        while True:
            found = self.pool.serving(model)
            if found:
                return found
            remaining = deadline - self.clock.now()
            if remaining <= 0:
                return []
            changed = self._changed
            # Also re-check every 0.1 s: a replica's models are learned by its health checks,
            # which do not go through apply().
            try:
                if changed is None:
                    await asyncio.sleep(min(remaining, 0.1))
                else:
                    await asyncio.wait_for(changed.wait(), min(remaining, 0.1))
            except asyncio.TimeoutError:
                pass

    # -- reload ---------------------------------------------------------------------------

    async def reconfigure(self, config: GatewayConfig) -> None:
        """A reloaded configuration: the static list's changes as events, discovery sources
        replaced when their settings changed (keeping what they found, so only differences
        turn into events), ``backend_defaults`` applied at each source's next poll."""
        old = self.config
        self.config = config
        new_static = {b.name: Member(b) for b in config.backends}
        for event in diff_members(self.static, new_static, STATIC):
            await self.apply(event)
        self.static = new_static
        if old.discovery == config.discovery and old.backend_defaults == config.backend_defaults:
            return
        async with self._lock:  # no source is inside apply() while they stop
            for task in self._tasks:
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        fresh = make_sources(config)
        gone = {source.name for source in self.sources} - {source.name for source in fresh}
        for source in fresh:
            # What the fleet holds from this source, so only differences become events.
            source.members = self._members_from(source.name)
        for name in gone:  # a source no longer configured: its replicas go
            for event in diff_members(self._members_from(name), {}, name):
                await self.apply(event)
        self.sources = fresh
        for source in fresh:
            await self._poll(source)
            self._tasks.append(asyncio.create_task(self._watch(source)))
        self._tasks.append(asyncio.create_task(self._reap_loop()))


    def _members_from(self, source: str) -> dict[str, Member]:
        return {name: entry.member for name, entry in self.entries.items()
                if entry.source == source}


def make_sources(config: GatewayConfig) -> list[Any]:
    """The discovery sources ``config`` asks for."""
    from prefixroute.edges.discovery.dns import DnsSource
    from prefixroute.edges.discovery.file import FileSource

    discovery = config.discovery
    if discovery is None:
        return []
    sources: list[Any] = []
    if discovery.file is not None:
        sources.append(FileSource(discovery.file, config.backend_defaults,
                                  discovery.file_interval_s))
    if discovery.dns is not None:
        sources.append(DnsSource(discovery.dns, config.backend_defaults))
    return sources
