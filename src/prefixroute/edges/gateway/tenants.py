"""Tenants: who is calling, which trust group's secret salt their requests carry, how fast
they may call.

A tenant is found by the SHA-256 of the bearer key it presents (keys are stored only as
digests). Its trust group's cache salt is ``derive_trust_group_salt(server_secret, group)``
(HMAC-SHA256, :mod:`prefixroute.core.identity.identity`): only requests of one trust group can
share cached KV on the engines, and no caller can compute another group's salt from its name
(docs/concepts.md, "Salts and trust groups"). Media identities are derived the same way,
scoped to the trust group, so a caller cannot pick one that collides with another group's
media.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from dataclasses import dataclass

from prefixroute.core.clock import Clock
from prefixroute.core.identity.identity import derive_trust_group_salt
from prefixroute.edges.gateway.config import RateLimit, TenantConfig, hash_api_key
from prefixroute.edges.gateway.errors import GatewayError


class TokenBucket:
    """``rate`` tokens a second up to ``burst``, starting full; a take costs ``cost`` tokens
    (one per request for a request limit, the prompt's tokens for a prompt-token limit).

    Time comes from an injected clock, so tests step it by hand.
    """

    def __init__(self, rate: float, burst: float, clock: Clock):
        self.rate = rate
        self.burst = float(burst)
        self._clock = clock
        self._tokens = self.burst
        self._at = clock.now()

    def try_take(self, cost: float = 1.0) -> float:
        """Take ``cost`` tokens: 0.0 on success, else the seconds until they are available
        (``math.inf`` for a cost above the burst: never)."""
        now = self._clock.now()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= cost:
            self._tokens -= cost
            return 0.0
        if cost > self.burst:
            return math.inf
        return (cost - self._tokens) / self.rate


@dataclass(frozen=True, slots=True)
class Tenant:
    """``bucket``: the tenant's request limit; ``token_bucket``: its prompt-token limit
    (each ``None`` when not limited)."""

    name: str
    trust_group: str
    cache_salt: str
    admin: bool
    bucket: TokenBucket | None
    token_bucket: TokenBucket | None = None


def _kept(bucket: TokenBucket | None, rate: float | None, burst: int,
          clock: Clock) -> TokenBucket | None:
    """``bucket`` if it has this rate and burst (a reload neither refills nor empties it),
    else a new one (``None`` without a rate)."""
    if rate is None:
        return None
    if bucket is not None and (bucket.rate, bucket.burst) == (rate, float(burst)):
        return bucket
    return TokenBucket(rate, burst, clock)


class TenantRegistry:
    """API key digest -> tenant, with each trust group's salt derived once at start."""

    def __init__(self, tenants: tuple[TenantConfig, ...], server_secret: bytes, clock: Clock,
                 previous: "TenantRegistry | None" = None):
        """``previous``: the registry this one replaces (a reload): a tenant whose rate
        limit did not change keeps its bucket, so a reload neither refills nor empties it."""
        self._secret = server_secret
        self._by_digest: dict[str, Tenant] = {}
        self.tenants: list[Tenant] = []
        kept = {t.name: t for t in previous.tenants} if previous is not None else {}
        for config in tenants:
            before = kept.get(config.name)
            limit = config.rate_limit or RateLimit(None, 0)
            bucket = _kept(before and before.bucket, limit.requests_per_second, limit.burst,
                           clock)
            token_bucket = _kept(before and before.token_bucket,
                                 limit.prompt_tokens_per_second, limit.prompt_tokens_burst,
                                 clock)
            tenant = Tenant(config.name, config.trust_group,
                            derive_trust_group_salt(server_secret, config.trust_group),
                            config.admin, bucket, token_bucket)
            self.tenants.append(tenant)
            for digest in config.api_key_hashes:
                self._by_digest[digest] = tenant

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an ``Authorization: Bearer KEY`` header, or a 401 error."""
        if not authorization:
            raise GatewayError(401, "missing API key: send 'Authorization: Bearer KEY'",
                               code="missing_api_key")
        scheme, _, key = authorization.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise GatewayError(401, "the Authorization header must be 'Bearer KEY'",
                               code="invalid_api_key")
        # A dict lookup on a SHA-256 digest: the presented key's hash, not the key, is what
        # gets compared, so lookup timing says nothing useful about stored keys.
        tenant = self._by_digest.get(hash_api_key(key))
        if tenant is None:
            raise GatewayError(401, "incorrect API key provided", code="invalid_api_key")
        return tenant

    def check_rate(self, tenant: Tenant) -> None:
        """Take one request from the tenant's request bucket, or raise 429 with Retry-After."""
        if tenant.bucket is None:
            return
        wait = tenant.bucket.try_take()
        if wait > 0:
            raise self.rate_error(tenant, wait)

    def check_prompt_tokens(self, tenant: Tenant, prompt_tokens: int) -> None:
        """Take ``prompt_tokens`` from the tenant's prompt-token bucket, or raise 429."""
        if tenant.token_bucket is None:
            return
        wait = tenant.token_bucket.try_take(prompt_tokens)
        if wait > 0:
            raise self.token_rate_error(tenant, prompt_tokens, wait)

    @staticmethod
    def rate_error(tenant: Tenant, wait: float) -> GatewayError:
        """The 429 of a tenant whose request bucket (local or shared) needs ``wait`` more
        seconds."""
        return GatewayError(429, f"rate limit of {tenant.bucket.rate:g} requests per second "
                            f"(burst {tenant.bucket.burst:g}) exceeded for this API key; "
                            f"retry in {wait:.2f} s", code="rate_limit_exceeded",
                            headers={"retry-after": str(max(1, math.ceil(wait)))})

    @staticmethod
    def token_rate_error(tenant: Tenant, prompt_tokens: int, wait: float) -> GatewayError:
        """The 429 of a request whose ``prompt_tokens`` the tenant's prompt-token bucket
        (local or shared) cannot cover for ``wait`` more seconds; a prompt above the burst
        can never pass, and its answer says so instead of a Retry-After."""
        bucket = tenant.token_bucket
        limit = (f"rate limit of {bucket.rate:g} prompt tokens per second (burst "
                 f"{bucket.burst:g})")
        if math.isinf(wait):
            return GatewayError(429, f"this request's {prompt_tokens} prompt tokens exceed "
                                f"the {limit} of this API key: it can never pass; send a "
                                f"shorter prompt or raise prompt_tokens_burst",
                                code="rate_limit_exceeded")
        return GatewayError(429, f"{limit} exceeded for this API key by this request's "
                            f"{prompt_tokens} prompt tokens; retry in {wait:.2f} s",
                            code="rate_limit_exceeded",
                            headers={"retry-after": str(max(1, math.ceil(wait)))})

    def media_uuid(self, tenant: Tenant, content_digest: str) -> str:
        """The identity a media item gets on the engines: HMAC of its content digest under the
        server secret and the trust group. Equal media share cache inside a group only; a
        caller can neither choose nor predict it: a caller-chosen id would replace the media's own
        hash in the engine's block keys (docs/concepts.md, "Media identity")."""
        message = f"prefixroute-media/v1/{tenant.trust_group}\x00{content_digest}".encode()
        return "pr-" + hmac.new(self._secret, message, hashlib.sha256).hexdigest()
