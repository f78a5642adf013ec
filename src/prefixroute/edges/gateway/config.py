"""The gateway's configuration: ``gateway.yaml``, read once at start and validated whole.

Every field, its default and where the default comes from is in ``docs/gateway.md``; the
defaults also live here, next to the code that reads them, as ``DEFAULTS``. A bad file never
starts a half-configured gateway: :func:`load_config` raises :class:`InputError` naming the
file, the line and the field (``gateway.yaml:14: must be at least 1 (field
'backends[0].url')``), which the CLI turns into exit code 2.

Secrets never sit in the file itself: tenants' API keys are stored as SHA-256 hex digests (a
leaked config does not leak keys), and the server secret that salts each trust group comes
from an environment variable or a file the config names.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from prefixroute.core.errors import ConfigError, InputError
from prefixroute.core.identity.hashing import VLLM_ALGOS
from prefixroute.core.identity.identity import MIN_SECRET_BYTES
from prefixroute.core.replica.engine import SCHEDULING_POLICIES
from prefixroute.core.routing.registry import create_policy, policy_names
from prefixroute.edges.yaml_reader import ConfigReader as _Reader
from prefixroute.edges.yaml_reader import kind as _kind
from prefixroute.edges.yaml_reader import load_yaml

SALT_POLICIES = ("reject", "strip")
# How prompts become block keys (docs/gateway.md, "Tokenization modes"): ``auto`` is the
# ``tokenizer`` mode when a tokenizer directory is configured, else ``chars``; ``backend`` asks
# a replica's render endpoint for the token ids (and media identities).
TOKENIZATION_MODES = ("auto", "tokenizer", "backend", "chars")
DEFAULT_RETRIES = 2  # a third replica before giving up; vLLM router and SGLang router retry too
DEFAULT_SHUTDOWN_GRACE_S = 30.0  # Kubernetes' default terminationGracePeriodSeconds
DEFAULT_DECISIONS_KEPT = 1000
# Recording: 100 MB files hold about 14,000 requests of 10,000-token prompts at 16-token
# blocks (625 ids of up to 10 digits dominate a line); ten of them keep the last quarter-million requests. A queue of
# 10,000 records rides out seconds of a stalled disk at thousands of requests per second.
DEFAULT_RECORD_ROTATE_MB = 100.0
DEFAULT_RECORD_KEEP = 10
DEFAULT_RECORD_QUEUE = 10_000
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,64}$")


def default_policy_spec() -> str:
    """The policy a gateway routes with when the config names none: the one place this is
    decided. ``prefixroute`` (the project's own policy) once it is
    registered; until then ``hybrid`` (affinity capped by load), and
    ``least_loaded`` if even that is missing."""
    names = policy_names()
    for name in ("prefixroute", "hybrid", "least_loaded"):
        if name in names:
            return name
    return names[0]


def hash_api_key(key: str) -> str:
    """The form an API key is stored in: SHA-256 of its UTF-8 bytes, lowercase hex
    (``printf %s "$KEY" | sha256sum``)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


# -- the configuration ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """Where a backend publishes KV events (vLLM ``--kv-events-config``).

    ``bind``: vLLM *connects* to a concrete tcp address, so the gateway must bind it; with
    ``tcp://*:PORT`` vLLM binds and the gateway connects to ``127.0.0.1:PORT``. ``auto`` (the default) follows that rule from the endpoint's text.
    """

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""  # a prefix filter; vLLM's default topic is empty
    bind: bool = True


@dataclass(frozen=True, slots=True)
class BackendConfig:
    name: str
    url: str
    models: tuple[str, ...] = ()  # empty: discovered from the backend's /v1/models
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA name -> path (hash key)
    kv_events: KVEventsConfig | None = None
    capacity_blocks: int | None = None  # KV blocks of the replica, for the approximate view
    api_key_env: str | None = None  # the backend's own API key, read from this env var
    prefill_s_per_token: float | None = None  # the replica's prefill speed, if measured
    # vllm serve --scheduling-policy of the replica: under "priority" the gateway sends the
    # policy's priority with each request.
    scheduling_policy: str = "fcfs"


DNS_RECORDS = ("a", "srv")
# CoreDNS's kubernetes plugin answers with a TTL of 5 s: re-resolving faster only re-reads
# its cache, slower leaves a new pod idle for longer.
DEFAULT_DNS_INTERVAL_S = 5.0
DEFAULT_FILE_INTERVAL_S = 1.0  # a file edit takes effect within about a second


@dataclass(frozen=True, slots=True)
class DnsDiscovery:
    """Replicas from the records of ``name``: A and AAAA (``record: a``, each address on
    ``port``), or SRV (``record: srv``, each target on its own port), asked of ``server``
    (``HOST:PORT``; ``None``: the system's resolvers) every ``interval_s``."""

    name: str
    port: int | None = None
    interval_s: float = DEFAULT_DNS_INTERVAL_S
    server: str | None = None
    record: str = "a"
    timeout_s: float = 2.0


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """Where replicas beyond the static ``backends`` come from (``edges/discovery``)."""

    file: Path | None = None
    file_interval_s: float = DEFAULT_FILE_INTERVAL_S
    dns: DnsDiscovery | None = None


TRACE_PROTOCOLS = ("http/protobuf", "grpc")


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """OpenTelemetry spans to an OTLP collector (``edges/gateway/tracing.py``; needs the
    ``tracing`` extra). ``endpoint`` None: the exporter's own default and ``OTEL_*``
    environment variables."""

    endpoint: str | None = None
    protocol: str = "http/protobuf"
    service_name: str = "prefixroute-gateway"
    sample_ratio: float = 1.0


@dataclass(frozen=True, slots=True)
class RateLimit:
    """A tenant's limits, each a token bucket: ``requests_per_second`` refill and ``burst``
    capacity in requests (``None``: requests are not limited); ``prompt_tokens_per_second``
    and ``prompt_tokens_burst`` the same in prompt tokens, a request costing its prompt's
    tokens (``None``: not limited)."""

    requests_per_second: float | None
    burst: int
    prompt_tokens_per_second: float | None = None
    prompt_tokens_burst: int = 0


@dataclass(frozen=True, slots=True)
class TenantConfig:
    name: str
    api_key_hashes: tuple[str, ...]
    trust_group: str
    rate_limit: RateLimit | None = None
    admin: bool = False  # may read every tenant's routing decisions at /debug/decisions


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float = 2.0
    read_s: float = 600.0
    write_s: float = 30.0
    pool_s: float = 5.0
    health_s: float = 2.0
    # A render call in ``tokenization: backend``; past it the request routes on its fallback.
    render_s: float = 1.0


@dataclass(frozen=True, slots=True)
class Limits:
    max_body_bytes: int = 4 * 1024 * 1024
    max_concurrent: int = 512
    max_queued: int = 1024
    queue_timeout_s: float = 30.0
    # The request line and headers together; OpenAI clients send under 2 KiB. nginx allows
    # 4 buffers of 8 KiB, Node.js 16 KiB; room for long tokens and tracing headers.
    max_header_bytes: int = 64 * 1024
    # To receive the request line and headers (from the connection's start or the request's
    # first byte), and then the body. nginx's client_header_timeout and client_body_timeout
    # are 60 s between reads; these bound the whole, so a caller trickling bytes cannot hold
    # a connection (and a queue slot) for long.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0


@dataclass(frozen=True, slots=True)
class HealthConfig:
    interval_s: float = 2.0
    metrics_interval_s: float = 1.0
    unhealthy_after: int = 2


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    failure_threshold: int = 5
    open_s: float = 10.0


@dataclass(frozen=True, slots=True)
class HashingConfig:
    block_size: int = 16
    algo: str = "sha256"
    none_hash_seed: str | None = None


@dataclass(frozen=True, slots=True)
class SharedStateConfig:
    """Several gateway instances share routing bookings and rate limits through this Redis
    (``edges/shared_state``); ``namespace`` prefixes its keys (one fleet per namespace)."""

    redis: str
    namespace: str = "prefixroute"


@dataclass(frozen=True, slots=True)
class RecordConfig:
    """Record served traffic as a trace the simulator replays (``edges/gateway/recorder.py``,
    docs/trace-format.md): files in the directory ``path``, a new one past ``rotate_mb``
    megabytes, the newest ``keep`` kept; at most ``queue`` records wait for the writer
    (beyond that a record is dropped and counted, never the request delayed)."""

    path: Path
    rotate_mb: float = DEFAULT_RECORD_ROTATE_MB
    keep: int = DEFAULT_RECORD_KEEP
    queue: int = DEFAULT_RECORD_QUEUE


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    backends: tuple[BackendConfig, ...]
    tenants: tuple[TenantConfig, ...]
    server_secret: bytes = field(repr=False)
    policy: str
    source: str = "<config>"
    tokenizer: Path | None = None
    # TOKENIZATION_MODES; "auto": "tokenizer" when a tokenizer is given, else "chars".
    tokenization: str = "auto"
    hashing: HashingConfig = HashingConfig()
    timeouts: Timeouts = Timeouts()
    limits: Limits = Limits()
    health: HealthConfig = HealthConfig()
    circuit_breaker: BreakerConfig = BreakerConfig()
    retries: int = DEFAULT_RETRIES
    caller_cache_salt: str = "reject"
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S
    # 0: off. Else the event loop polls without sleeping while requests are open and for this
    # long after the last one ends (edges/gateway/busypoll.py says when that pays).
    busy_poll_s: float = 0.0
    decisions_kept: int = DEFAULT_DECISIONS_KEPT
    seed: int = 0
    discovery: DiscoveryConfig | None = None
    # The settings of a discovered backend that its source does not give (a DNS record gives
    # only an address), as a ``backends[]`` entry without url and name.
    backend_defaults: dict[str, Any] = field(default_factory=dict)
    tracing: TracingConfig | None = None
    shared_state: SharedStateConfig | None = None
    record: RecordConfig | None = None


# -- sections --------------------------------------------------------------------------------


def _check_url(reader: _Reader, key: str, url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        reader.fail(f"expected an http:// or https:// URL with a host, got {url!r}", key)
    try:
        parts.port
    except ValueError:
        reader.fail(f"bad port in {url!r}", key)
    return url.rstrip("/")


def _check_zmq_endpoint(reader: _Reader, key: str, endpoint: str) -> str:
    if not re.match(r"^(tcp://[^:]+:\d+|ipc://.+|inproc://.+)$", endpoint):
        reader.fail(f"expected a ZMQ endpoint like tcp://127.0.0.1:5557, got {endpoint!r}", key)
    return endpoint


def _kv_events(reader: _Reader) -> KVEventsConfig:
    endpoint = _check_zmq_endpoint(reader, "endpoint", reader.string("endpoint", required=True))
    replay = reader.string("replay_endpoint")
    if replay is not None:
        replay = _check_zmq_endpoint(reader, "replay_endpoint", replay)
        if "*" in replay:
            reader.fail("the gateway connects to the replay socket: give a concrete address "
                        "(vLLM binds it)", "replay_endpoint")
    topic = reader.raw("topic", "")
    if not isinstance(topic, str):
        reader.fail(f"expected a string, got {_kind(topic)}", "topic")
    bind_value = reader.raw("bind", "auto")
    if bind_value == "auto":
        bind = "*" not in endpoint
    elif isinstance(bind_value, bool):
        bind = bind_value
    else:
        reader.fail(f"expected true, false or auto, got {_kind(bind_value)}", "bind")
    if "*" in endpoint:
        if bind:
            reader.fail("cannot bind a wildcard the engine binds; use bind: false", "bind")
        endpoint = endpoint.replace("*", "127.0.0.1")
    reader.finish()
    return KVEventsConfig(endpoint, replay, topic, bind)


def _backend(reader: _Reader, index: int | None) -> BackendConfig:
    """One ``backends[]`` entry; ``index`` None (a discovered entry): named after its
    address unless it names itself, since a position in a changing list is no identity."""
    url = _check_url(reader, "url", reader.string("url", required=True))
    name = reader.string("name", f"r{index}" if index is not None else address_name(url))
    if not _NAME.match(name):
        reader.fail("names are 1-64 letters, digits or _.:@-", "name")
    models_raw = reader.raw("models", [])
    if isinstance(models_raw, str):
        models_raw = [models_raw]
    if not isinstance(models_raw, list) or not all(isinstance(m, str) and m for m in models_raw):
        reader.fail("expected a list of model names", "models")
    adapters_raw = reader.raw("adapters", {})
    if not isinstance(adapters_raw, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in adapters_raw.items()):
        reader.fail("expected a mapping of LoRA adapter name to its path, as vLLM was "
                    "started with (--lora-modules NAME=PATH)", "adapters")
    kv_events = None
    if reader.has("kv_events"):
        kv_events = _kv_events(reader.section("kv_events"))
    else:
        reader.used.add("kv_events")
    capacity = reader.integer("capacity_blocks", None, minimum=1)
    api_key_env = reader.string("api_key_env")
    prefill_speed = reader.number("prefill_s_per_token", 0.0) if reader.has(
        "prefill_s_per_token") else None
    reader.used.add("prefill_s_per_token")
    scheduling = reader.string("scheduling_policy", "fcfs", choices=SCHEDULING_POLICIES)
    reader.finish()
    return BackendConfig(name, url, tuple(dict.fromkeys(models_raw)), dict(adapters_raw),
                         kv_events, capacity, api_key_env, prefill_speed, scheduling)


def address_name(url: str) -> str:
    """A discovered backend's default name: its ``host:port``."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{host}:{port}"


_DEFAULTS_FIELDS = ("models", "adapters", "capacity_blocks", "api_key_env",
                    "prefill_s_per_token", "scheduling_policy")


def parse_backend_defaults(reader: _Reader) -> dict[str, Any]:
    """``backend_defaults``: the fields of a ``backends[]`` entry a discovered backend takes
    when its source does not give them (checked here by parsing them once with a stand-in
    address, so a bad default fails at load, not at the first discovery)."""
    data = dict(reader.data)
    for key in data:
        if key not in _DEFAULTS_FIELDS:
            reader.fail(f"unknown key {key!r} (known here: {', '.join(_DEFAULTS_FIELDS)}; a "
                        "discovered backend's name, url and KV events endpoint are its own)",
                        str(key), reader.lines.get(key, reader.line))
    probe = _Reader(reader.source, {**data, "url": "http://127.0.0.1:1", "name": "defaults"},
                    reader.path, reader.line)
    _backend(probe, None)
    return data


def parse_backend_list(data: Any, source: str, defaults: dict[str, Any]) -> \
        list[tuple[BackendConfig, bool, int]]:
    """A membership file: a list of ``backends[]`` entries (each may add ``draining: true``
    and ``generation: N``, bumped when the engine at that address restarted), or a mapping
    with such a list under ``backends``. Entries take ``defaults`` for fields they omit.
    Returns (backend, draining, generation) per entry; :class:`InputError` if bad."""
    if isinstance(data, dict) and "backends" in data:
        top = _Reader(source, data, "", 1)
        items = top.sequence("backends", required=True)
        top.finish()
        prefix = "backends"
    elif isinstance(data, list):
        items, prefix = data, ""
    else:
        raise InputError(f"expected a list of backends, got {_kind(data)}", where=source)
    out = []
    names: set[str] = set()
    for i, item in enumerate(items):
        path = f"{prefix}[{i}]"
        line = getattr(item, "line", getattr(data, "line", 1))
        _Reader(source, item, path, line)  # a mapping, or an error naming the entry
        reader = _Reader(source, {**defaults, **item}, path, line)
        reader.lines = getattr(item, "lines", {})  # errors name the entry's own lines
        draining = reader.boolean("draining", False)
        generation = reader.integer("generation", 0, minimum=0)
        backend = _backend(reader, None)
        if backend.name in names:
            reader.fail(f"backend name {backend.name!r} is used twice", "name")
        names.add(backend.name)
        out.append((backend, draining, generation))
    return out


def _discovery(reader: _Reader, base: Path) -> DiscoveryConfig:
    file = reader.string("file")
    path = None
    if file is not None:
        path = Path(file) if Path(file).is_absolute() else (base / file).resolve()
    interval = reader.number("file_interval_s", DEFAULT_FILE_INTERVAL_S)
    if interval <= 0:
        reader.fail("must be above 0", "file_interval_s")
    dns = None
    if reader.has("dns"):
        d = reader.section("dns")
        record = d.string("record", "a", choices=DNS_RECORDS)
        port = d.integer("port", None, minimum=1)
        if port is not None and port > 65535:
            d.fail("must be at most 65535", "port")
        if record == "a" and port is None:
            d.missing("port", "is required with A/AAAA records (they carry no port)")
        server = d.string("server")
        if server is not None:
            host, sep, server_port = server.rpartition(":")
            if not sep or not host or not server_port.isdigit():
                d.fail(f"expected HOST:PORT, got {server!r}", "server")
        dns_interval = d.number("interval_s", DEFAULT_DNS_INTERVAL_S)
        if dns_interval <= 0:
            d.fail("must be above 0", "interval_s")
        timeout = d.number("timeout_s", 2.0)
        if timeout <= 0:
            d.fail("must be above 0", "timeout_s")
        dns = DnsDiscovery(d.string("name", required=True).rstrip(".") + ".", port,
                           dns_interval, server, record, timeout)
        d.finish()
    else:
        reader.used.add("dns")
    reader.finish()
    if path is None and dns is None:
        reader.fail("give file (a watched list of backends) and/or dns")
    return DiscoveryConfig(path, interval, dns)


def _bucket(rl: _Reader, rate_field: str, burst_field: str, orphan_burst: str) -> tuple[float | None, int]:
    """One token bucket of a tenant's ``rate_limit``: its rate and burst, (None, 0) when the
    rate is not given. The burst defaults to one second's worth (at least 1)."""
    if rl.has(rate_field):
        rate = rl.number(rate_field, 0.0)
        return rate, rl.integer(burst_field, max(1, int(rate)), minimum=1)
    if rl.has(burst_field):
        rl.fail(orphan_burst, burst_field)
    return None, 0


def _tenant(reader: _Reader) -> TenantConfig:
    name = reader.string("name", required=True)
    if not _NAME.match(name):
        reader.fail("names are 1-64 letters, digits or _.:@-", "name")
    hashes: list[str] = []
    single = reader.raw("api_key_sha256")
    many = reader.raw("api_keys_sha256", [])
    if single is not None:
        many = [single, *many] if isinstance(many, list) else many
    if not isinstance(many, list) or not many:
        reader.fail("needs api_key_sha256 (or a list api_keys_sha256): the SHA-256 hex of "
                    "each key, e.g. printf %s \"$KEY\" | sha256sum", "api_key_sha256")
    for value in many:
        if not isinstance(value, str) or not _HEX64.match(value.lower()):
            reader.fail("an API key is stored as 64 hex characters (its SHA-256), not in the "
                        "clear", "api_key_sha256" if single is not None else "api_keys_sha256")
        hashes.append(value.lower())
    trust_group = reader.string("trust_group", name)
    rate_limit = None
    if reader.has("rate_limit"):
        rl = reader.section("rate_limit")
        if not rl.has("requests_per_second") and not rl.has("prompt_tokens_per_second"):
            rl.missing("requests_per_second", "is required (or prompt_tokens_per_second)")
        rps, burst = _bucket(rl, "requests_per_second", "burst",
                             "burst is the requests' burst: give requests_per_second with it")
        tps, token_burst = _bucket(rl, "prompt_tokens_per_second", "prompt_tokens_burst",
                                   "give prompt_tokens_per_second with prompt_tokens_burst")
        rl.finish()
        rate_limit = RateLimit(rps, burst, tps, token_burst)
    else:
        reader.used.add("rate_limit")
    admin = reader.boolean("admin", False)
    reader.finish()
    return TenantConfig(name, tuple(hashes), trust_group, rate_limit, admin)


def _server_secret(reader: _Reader, base: Path) -> bytes:
    """The server secret's bytes, as the variable or file holds them (they key the salts, so
    the form is not changed), once :func:`secret_strength` finds 32 bytes of key in them. No
    message here quotes the value."""
    env = reader.string("env")
    file = reader.string("file")
    reader.finish()
    if (env is None) == (file is None):
        reader.fail("give exactly one of env (an environment variable) or file (a path)")
    if env is not None:
        value = os.environ.get(env)
        if value is None:
            reader.fail(f"environment variable {env} is not set", "env")
        secret = value.encode("utf-8")
        where = f"environment variable {env}"
    else:
        path = (base / file).resolve() if not Path(file).is_absolute() else Path(file)
        try:
            secret = path.read_bytes().rstrip(b"\r\n")
        except OSError as exc:
            reader.fail(f"cannot read the secret file {path}: {exc.strerror}", "file")
        where = f"secret file {path}"
    strength, form = secret_strength(secret)
    if strength < MIN_SECRET_BYTES:
        reader.fail(f"{where} holds {form} worth {strength} bytes of key; the server secret "
                    f"needs at least {MIN_SECRET_BYTES} (256 bits): make one with "
                    "openssl rand -hex 32", "env" if env is not None else "file")
    return secret


_HEX = re.compile(rb"(?:[0-9a-fA-F]{2})+")
_PRINTABLE = re.compile(rb"[\x21-\x7e]+")


def secret_strength(secret: bytes) -> tuple[int, str]:
    """How many bytes of key ``secret`` can hold at most, and the form that says so.

    Text carries less than a byte per character: hex (``openssl rand -hex``) two characters
    a byte, other printable text at most base64's 6 bits a character (``openssl rand -base64``;
    a passphrase holds less still). Anything else is counted as raw bytes."""
    if _HEX.fullmatch(secret):
        return len(secret) // 2, f"{len(secret)} hex characters"
    if _PRINTABLE.fullmatch(secret):
        return len(secret.rstrip(b"=")) * 6 // 8, f"{len(secret)} characters of text"
    return len(secret), f"{len(secret)} raw bytes"


def parse_config(data: Any, source: str = "<config>", base: Path | None = None) -> GatewayConfig:
    """Validate an already parsed config mapping (``load_config`` adds the file reading)."""
    base = base or Path.cwd()
    top = _Reader(source, data, "", 1)

    discovery = None
    if top.has("discovery"):
        discovery = _discovery(top.section("discovery"), base)
    else:
        top.used.add("discovery")
    backend_defaults: dict[str, Any] = {}
    if top.has("backend_defaults"):
        backend_defaults = parse_backend_defaults(top.section("backend_defaults"))
    else:
        top.used.add("backend_defaults")
    tracing = None
    if top.has("tracing"):
        tr = top.section("tracing")
        ratio = tr.number("sample_ratio", 1.0, non_negative=True)
        if ratio > 1:
            tr.fail("a ratio between 0 and 1", "sample_ratio")
        tracing = TracingConfig(tr.string("endpoint"),
                                tr.string("protocol", "http/protobuf", choices=TRACE_PROTOCOLS),
                                tr.string("service_name", "prefixroute-gateway"), ratio)
        tr.finish()
    else:
        top.used.add("tracing")
    backends_raw = top.sequence("backends", required=discovery is None)
    if not backends_raw and discovery is None:
        top.fail("needs at least one backend (or discovery)", "backends")
    backends = []
    for i, item in enumerate(backends_raw):
        reader = _Reader(source, item, f"backends[{i}]", top.item_line("backends", item))
        backends.append(_backend(reader, i))
    names = [b.name for b in backends]
    for i, name in enumerate(names):
        if names.index(name) != i:
            top.fail(f"backend name {name!r} is used twice", "backends",
                     top.item_line("backends", backends_raw[i]))

    tenants_raw = top.sequence("tenants", required=True)
    if not tenants_raw:
        top.fail("needs at least one tenant (every request is authenticated)", "tenants")
    tenants = []
    seen_keys: dict[str, str] = {}
    for i, item in enumerate(tenants_raw):
        reader = _Reader(source, item, f"tenants[{i}]", top.item_line("tenants", item))
        tenant = _tenant(reader)
        for digest in tenant.api_key_hashes:
            if digest in seen_keys:
                reader.fail(f"this API key already belongs to tenant {seen_keys[digest]!r}",
                            "api_key_sha256")
            seen_keys[digest] = tenant.name
        tenants.append(tenant)
    if len({t.name for t in tenants}) != len(tenants):
        top.fail("tenant names must be unique", "tenants")

    if not top.has("server_secret"):
        top.missing("server_secret", "is required: {env: VARIABLE} or {file: PATH} holding "
                    f"at least {MIN_SECRET_BYTES} bytes")
    if not isinstance(top.data["server_secret"], dict):  # the value itself, maybe the secret
        top.fail("must be {env: VARIABLE} or {file: PATH}: the secret itself never goes in "
                 "the config file (make one with openssl rand -hex 32)", "server_secret")
    secret = _server_secret(top.section("server_secret"), base)

    hashing_reader = top.section("hashing")
    hashing = HashingConfig(
        block_size=hashing_reader.integer("block_size", HashingConfig().block_size, minimum=1),
        algo=hashing_reader.string("algo", HashingConfig().algo, choices=VLLM_ALGOS),
        none_hash_seed=hashing_reader.string("none_hash_seed"))
    if hashing.algo.startswith("xxhash") and hashing.none_hash_seed is None:
        hashing_reader.fail("vLLM seeds xxhash with a random per-process value unless "
                            "PYTHONHASHSEED is set; set it on the engine and give it here",
                            "none_hash_seed")
    hashing_reader.finish()

    policy = top.string("policy") or default_policy_spec()
    try:
        create_policy(policy, seed=0, num_replicas=max(1, len(backends)), block_size=hashing.block_size)
    except ConfigError as exc:
        top.fail(str(exc), "policy")

    tokenizer = None
    tokenizer_text = top.string("tokenizer")
    if tokenizer_text is not None:
        tokenizer = Path(tokenizer_text)
        if not tokenizer.is_absolute():
            tokenizer = (base / tokenizer).resolve()
        if not (tokenizer / "tokenizer.json").is_file():
            top.fail(f"no tokenizer.json in {tokenizer}", "tokenizer")
    tokenization = top.string("tokenization", "auto", choices=TOKENIZATION_MODES)
    if tokenization == "tokenizer" and tokenizer is None:
        top.fail("tokenization: tokenizer needs 'tokenizer' (the served model's tokenizer "
                 "directory); without one use backend (the replicas' render endpoint) or "
                 "chars", "tokenization")
    elif tokenization == "chars" and tokenizer is not None:
        top.fail("tokenization: chars does not use the configured 'tokenizer'; remove one of "
                 "the two (auto uses the tokenizer when one is given)", "tokenization")

    t = top.section("timeouts")
    timeouts = Timeouts(t.number("connect_s", Timeouts().connect_s),
                        t.number("read_s", Timeouts().read_s),
                        t.number("write_s", Timeouts().write_s),
                        t.number("pool_s", Timeouts().pool_s),
                        t.number("health_s", Timeouts().health_s),
                        t.number("render_s", Timeouts().render_s))
    t.finish()
    lim = top.section("limits")
    limits = Limits(lim.integer("max_body_bytes", Limits().max_body_bytes, minimum=1024),
                    lim.integer("max_concurrent", Limits().max_concurrent, minimum=1),
                    lim.integer("max_queued", Limits().max_queued, minimum=0),
                    lim.number("queue_timeout_s", Limits().queue_timeout_s),
                    lim.integer("max_header_bytes", Limits().max_header_bytes, minimum=1024),
                    lim.number("header_timeout_s", Limits().header_timeout_s),
                    lim.number("body_timeout_s", Limits().body_timeout_s))
    lim.finish()
    h = top.section("health")
    health = HealthConfig(h.number("interval_s", HealthConfig().interval_s),
                          h.number("metrics_interval_s", HealthConfig().metrics_interval_s),
                          h.integer("unhealthy_after", HealthConfig().unhealthy_after, minimum=1))
    h.finish()
    cb = top.section("circuit_breaker")
    breaker = BreakerConfig(cb.integer("failure_threshold", BreakerConfig().failure_threshold,
                                       minimum=1),
                            cb.number("open_s", BreakerConfig().open_s))
    cb.finish()

    shared_state = None
    if top.has("shared_state"):
        ss = top.section("shared_state")
        url = ss.string("redis", required=True)
        if not url.startswith(("redis://", "rediss://", "unix://")):
            ss.fail("a Redis URL: redis://HOST:PORT[/DB], rediss://... or unix://PATH",
                    "redis")
        shared_state = SharedStateConfig(url, ss.string("namespace", "prefixroute"))
        ss.finish()
    else:
        top.used.add("shared_state")

    record = None
    if top.has("record"):
        rec = top.section("record")
        record = RecordConfig(base / rec.string("path", required=True),
                              rec.number("rotate_mb", DEFAULT_RECORD_ROTATE_MB),
                              rec.integer("keep", DEFAULT_RECORD_KEEP, minimum=1),
                              rec.integer("queue", DEFAULT_RECORD_QUEUE, minimum=1))
        rec.finish()
    else:
        top.used.add("record")

    config = GatewayConfig(
        shared_state=shared_state, record=record,
        backends=tuple(backends), tenants=tuple(tenants), server_secret=secret, policy=policy,
        source=source, tokenizer=tokenizer, tokenization=tokenization, hashing=hashing, timeouts=timeouts, limits=limits,
        health=health, circuit_breaker=breaker,
        retries=top.integer("retries", DEFAULT_RETRIES, minimum=0),
        caller_cache_salt=top.string("caller_cache_salt", "reject", choices=SALT_POLICIES),
        shutdown_grace_s=top.number("shutdown_grace_s", DEFAULT_SHUTDOWN_GRACE_S),
        busy_poll_s=top.number("busy_poll_s", 0.0, non_negative=True),
        decisions_kept=top.integer("decisions_kept", DEFAULT_DECISIONS_KEPT, minimum=1),
        seed=top.integer("seed", 0, minimum=0),
        discovery=discovery, backend_defaults=backend_defaults, tracing=tracing)
    top.finish()
    return config


def load_config(path: str | os.PathLike) -> GatewayConfig:
    """Read and validate ``gateway.yaml``; :class:`InputError` (file:line, field) if bad."""
    path = Path(path)
    data = load_yaml(path, "config")
    return parse_config(data, str(path), path.parent)
