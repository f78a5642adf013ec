"""Per-tenant rate limits enforced across every instance, atomically, in Redis.

The limit is the gateway's token bucket (:class:`prefixroute.edges.gateway.tenants.TokenBucket`)
with the same meaning: ``rate`` tokens a second up to ``burst``, starting full; a request takes
``cost`` tokens (one per request) or is refused with the seconds until it could. Only the
place of the bucket changes: one hash per tenant in Redis, ``{tokens, at}``, updated by a Lua
script, so that a check-and-take by any instance is one atomic step (Redis runs a script to
the end before any other command) and the tenant's rate holds for the fleet, not per
instance. The script reads Redis's own clock (``TIME``), so instances need no synchronised
clocks. A script may check several buckets at once (all or nothing), which is how a second
limit (prompt tokens per second, say) joins without a second round trip.

Redis unavailable: the check falls back to the instance's local bucket (the limit then holds
per instance, not for the fleet) and no request fails because of it.
"""

from __future__ import annotations

from typing import Sequence

from prefixroute.edges.shared_state.link import REDIS_ERRORS, RedisLink

# KEYS: one bucket hash per limit. ARGV: (rate, burst, cost) per key, then the expiry margin.
# Returns "0" when taken, else the seconds (a string: Lua numbers would be truncated to
# integers) until every bucket holds its cost.
TAKE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local n = #KEYS
local tokens, wait = {}, 0
for i = 1, n do
  local rate = tonumber(ARGV[3 * i - 2])
  local burst = tonumber(ARGV[3 * i - 1])
  local cost = tonumber(ARGV[3 * i])
  local state = redis.call('HMGET', KEYS[i], 'tokens', 'at')
  local have = tonumber(state[1])
  local at = tonumber(state[2])
  if have == nil or at == nil then have = burst; at = now end
  if now > at then have = math.min(burst, have + (now - at) * rate) end
  tokens[i] = have
  if have < cost then wait = math.max(wait, (cost - have) / rate) end
end
for i = 1, n do
  local rate = tonumber(ARGV[3 * i - 2])
  local burst = tonumber(ARGV[3 * i - 1])
  local have = tokens[i]
  if wait == 0 then have = have - tonumber(ARGV[3 * i]) end
  redis.call('HSET', KEYS[i], 'tokens', string.format('%.17g', have),
             'at', string.format('%.17g', now))
  redis.call('PEXPIRE', KEYS[i], math.ceil(burst / rate * 1000) + tonumber(ARGV[3 * n + 1]))
end
return string.format('%.17g', wait)
"""

EXPIRY_MARGIN_MS = 60_000  # a bucket left alone this long after refilling is deleted (full)


class SharedRateLimiter:
    def __init__(self, link: RedisLink, namespace: str):
        self.link = link
        self.namespace = namespace
        self._script = link.client.register_script(TAKE_SCRIPT)

    def key(self, tenant: str, limit: str = "requests") -> str:
        return f"{self.namespace}:ratelimit:{tenant}:{limit}"

    async def try_take(self, tenant: str,
                       buckets: Sequence[tuple[str, float, float, float]]) -> float | None:
        """Take ``cost`` from each ``(limit, rate, burst, cost)`` bucket of ``tenant``, all or
        none: 0.0 on success, else the seconds until possible; ``None`` when Redis could not
        answer (the caller uses its local bucket)."""
        if not self.link.usable():
            self.link.metrics.local_limits.inc()
            return None
        keys = [self.key(tenant, name) for name, _, _, _ in buckets]
        args: list[float | int] = []
        for _, rate, burst, cost in buckets:
            args += [rate, burst, cost]
        args.append(EXPIRY_MARGIN_MS)
        try:
            wait = await self._script(keys=keys, args=args)
        except REDIS_ERRORS as exc:
            self.link.failed("ratelimit", exc)
            self.link.metrics.local_limits.inc()
            return None
        self.link.metrics.operations.labels("ratelimit").inc()
        self.link.ok()
        return float(wait)
