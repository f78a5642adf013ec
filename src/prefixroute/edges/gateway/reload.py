"""Reloading the configuration while serving (``SIGHUP``, ``POST /admin/reload``).

The new file is read and validated whole first; an invalid one is refused with the reason
(file, line, field) and the running configuration stays. A valid one is applied without
dropping a request:

* tenants, their keys, trust groups and rate limits: a new registry, swapped in at once
  (a request already past authentication keeps its tenant); a tenant whose rate limit did
  not change keeps its bucket;
* ``limits``: the admission queue is resized in place (requests in it keep their place);
* ``policy``: a new policy object routes from the next request; the replicas' cache views,
  counts and in-flight requests stay;
* ``retries``, ``decisions_kept``, ``health``, ``circuit_breaker`` (for replicas that join
  from now on), ``shutdown_grace_s``;
* ``backends``, ``discovery``, ``backend_defaults``: as membership events
  (:class:`~prefixroute.edges.gateway.fleet.Fleet`).

What a running gateway cannot take over (it changes what every cached block is called, or
how the process was built) is refused with the field named: ``hashing``, ``tokenizer``,
``tokenization``, ``timeouts``, ``busy_poll_s``, ``seed``, ``tracing``, ``record``.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from prefixroute.core.errors import ConfigError
from prefixroute.core.routing.registry import create_policy
from prefixroute.edges.gateway.config import GatewayConfig
from prefixroute.edges.gateway.tenants import TenantRegistry

log = logging.getLogger("prefixroute.gateway")

FIXED_FIELDS = ("hashing", "tokenizer", "tokenization", "timeouts", "busy_poll_s", "seed",
                "tracing", "record")


class ReloadRefused(ConfigError):
    """The new configuration cannot be applied; the running one stays."""


def check_reloadable(old: GatewayConfig, new: GatewayConfig) -> None:
    for name in FIXED_FIELDS:
        if getattr(old, name) != getattr(new, name):
            raise ReloadRefused(f"{new.source}: '{name}' cannot change while the gateway "
                                "runs (it changes how prompts become block keys or how the "
                                "process was built); restart the gateway for it")


async def apply_config(gateway: Any, new: GatewayConfig) -> dict[str, Any]:
    """Apply ``new`` to ``gateway`` (module docstring); returns what changed."""
    old: GatewayConfig = gateway.config
    check_reloadable(old, new)
    policy = None
    if new.policy != old.policy:
        try:
            policy = create_policy(new.policy, seed=new.seed,
                                   num_replicas=max(1, len(gateway.pool.backends)),
                                   block_size=new.hashing.block_size)
        except ConfigError as exc:
            raise ReloadRefused(f"{new.source}: policy: {exc}") from None
    changed = [name for name in GatewayConfig.__dataclass_fields__
               if name not in ("source", "server_secret")
               and getattr(old, name) != getattr(new, name)]
    if old.server_secret != new.server_secret:
        changed.append("server_secret")

    gateway.tenants = TenantRegistry(new.tenants, new.server_secret, gateway.clock,
                                     previous=gateway.tenants)
    limits = new.limits
    await gateway.admission.resize(limits.max_concurrent, limits.max_queued, limits.queue_timeout_s)
    if policy is not None:
        gateway.router.replace_policy(policy)
        if getattr(gateway, "recorder", None) is not None:
            gateway.recorder.set_policy(new.policy)
    if gateway.proxy is not None:
        gateway.proxy.retries = new.retries
    if new.decisions_kept != old.decisions_kept:
        gateway.router.decisions = deque(gateway.router.decisions, maxlen=new.decisions_kept)
    gateway.config = new
    gateway.pool.config = new
    await gateway.fleet.reconfigure(new)
    log.info("configuration reloaded", extra={"fields": {
        "event": "reloaded", "source": new.source, "changed": changed,
        "tenants": len(new.tenants), "policy": new.policy}})
    return {"status": "reloaded", "source": new.source, "changed": changed,
            "tenants": [t.name for t in new.tenants], "policy": new.policy,
            "backends": [b["name"] for b in gateway.fleet.describe()]}
