"""``prefixroute doctor``: check that the gateway's tokenization and hashing agree with an engine.

``prefixroute doctor --gateway URL [--json]`` instead reads a running gateway's ``/metrics`` and
shows each replica's cache view: ``exact`` (every KV event batch arrived, live or replayed),
``degraded`` (a batch was lost beyond the engine's replay buffer; a warning), or ``approximate``
(no KV events), with the batches lost and the event-stream restarts it saw.

``prefixroute doctor --backend URL [--tokenizer DIR] [--model NAME] [--block-size N]
[--hash-algo A] [--kv-events ENDPOINT] [--json]`` probes one engine (vLLM or the emulator)
under fresh random cache salts and reports each check as ok, warn, fail or skip: cached tokens
reported, the prefix hit the block size predicts, salt isolation, KV event ids equal to the
gateway's keys, and (with a tokenizer) completion and chat-template tokenization. Exit 0 when
nothing failed, 1 when a check failed, 2 when the engine cannot be probed at all.
"""

from __future__ import annotations

import os

import httpx

from prefixroute.core.errors import InputError
from prefixroute.core.identity.hashing import VLLM_ALGOS
from prefixroute.edges.cli.common import (add_json_argument, check_json_destination, emit_json,
                                          positive_int)

MARKS = {"ok": "ok  ", "fail": "FAIL", "warn": "warn", "skip": "skip"}


def register(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="check the gateway's tokenization and hashing "
                              "against an engine", description=__doc__.split("\n\n")[0])
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--backend", metavar="URL",
                        help="the engine's base URL, e.g. http://127.0.0.1:8001")
    target.add_argument("--gateway", metavar="URL",
                        help="a running gateway's base URL: show each replica's cache view "
                             "(exact, degraded or approximate) from its /metrics")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="the tokenizer directory the gateway is configured with (the "
                        "served model's; 'prefixroute tokenizer --tiny DIR' makes a small "
                        "offline one for trials)")
    p.add_argument("--model", help="model to probe (default: the first the engine lists)")
    p.add_argument("--block-size", type=positive_int,
                   help="the gateway's block size (default: the engine's, from /metrics)")
    p.add_argument("--hash-algo", choices=VLLM_ALGOS,
                   help="the gateway's hash algorithm (default: the engine's, else sha256)")
    p.add_argument("--none-hash-seed", help="PYTHONHASHSEED the engine runs with, if any")
    p.add_argument("--kv-events", metavar="ENDPOINT",
                   help="the engine's KV events endpoint (its --kv-events-config endpoint)")
    p.add_argument("--kv-events-connect", action="store_true",
                   help="connect to the endpoint (the engine binds tcp://*:PORT) instead of "
                        "binding it (the engine connects to a concrete address; default)")
    p.add_argument("--kv-topic", default="", help="KV events topic prefix (default: all)")
    p.add_argument("--api-key-env", metavar="VAR",
                   help="environment variable holding the engine's API key, if it needs one")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds per request (default 60: CPU engines are slow)")
    add_json_argument(p, "the checks")
    p.set_defaults(handler=run)


def run(args) -> int:
    check_json_destination(args.json)
    if args.gateway:
        return run_gateway(args)
    from prefixroute.edges.gateway.doctor import Doctor, ProbeError

    tokenizer = None
    if args.tokenizer:
        from prefixroute.edges.tokenization import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    if not args.backend.startswith(("http://", "https://")):
        raise InputError(f"--backend must be an http:// or https:// URL, got {args.backend!r}")
    headers = {}
    if args.api_key_env:
        key = os.environ.get(args.api_key_env)
        if not key:
            raise InputError(f"--api-key-env: {args.api_key_env} is not set")
        headers["authorization"] = f"Bearer {key}"
    events = None
    if args.kv_events:
        from prefixroute.edges.kvevents.zmq import KVEventSubscriber

        endpoint = args.kv_events.replace("*", "127.0.0.1")
        try:
            events = KVEventSubscriber(endpoint, bind=not args.kv_events_connect,
                                       topic=args.kv_topic, expect_first_seq=None,
                                       skip_unknown_events=True).start()
        except Exception as exc:  # zmq.ZMQError
            raise InputError(f"--kv-events {args.kv_events}: {exc}") from None
    try:
        with httpx.Client(base_url=args.backend.rstrip("/"), timeout=args.timeout,
                          headers=headers) as client:
            doctor = Doctor(client, model=args.model, tokenizer=tokenizer,
                            block_size=args.block_size, hash_algo=args.hash_algo,
                            none_hash_seed=args.none_hash_seed, events=events)
            try:
                checks = doctor.run()
            except ProbeError as exc:
                raise InputError(str(exc), where=args.backend) from None
    finally:
        if events is not None:
            events.stop()
    if args.json:
        emit_json({"backend": args.backend, "model": doctor.model,
                    "block_size": doctor.block_size, "ok": doctor.ok,
                    "checks": [c.as_dict() for c in checks]}, args.json)
    else:
        print(f"prefixroute doctor: {args.backend} model {doctor.model!r}, block size "
              f"{doctor.block_size}")
        for check in checks:
            print(f"  [{MARKS.get(check.status, check.status)}] {check.name}: {check.detail}")
        print("all checks passed" if doctor.ok else "some checks FAILED")
    return 0 if doctor.ok else 1


def run_gateway(args) -> int:
    """Each replica's view state as a running gateway sees it: exit 0 (a degraded view is a
    warning), 2 when the gateway cannot be read."""
    from prefixroute.edges.gateway.doctor import gateway_view_checks, gateway_view_states

    if not args.gateway.startswith(("http://", "https://")):
        raise InputError(f"--gateway must be an http:// or https:// URL, got {args.gateway!r}")
    try:
        response = httpx.get(args.gateway.rstrip("/") + "/metrics", timeout=args.timeout)
        response.raise_for_status()
        states = gateway_view_states(response.text)
    except (httpx.HTTPError, ValueError) as exc:
        raise InputError(f"cannot read the gateway's metrics: {exc}",
                         where=args.gateway) from None
    if not states:
        raise InputError("no replica metrics at /metrics: is this a prefixroute gateway?",
                         where=args.gateway)
    checks = gateway_view_checks(states)
    if args.json:
        emit_json({"gateway": args.gateway, "ok": True,
                   "checks": [c.as_dict() for c in checks]}, args.json)
    else:
        print(f"prefixroute doctor: gateway {args.gateway}, {len(states)} replicas")
        for check in checks:
            print(f"  [{MARKS.get(check.status, check.status)}] {check.name}: {check.detail}")
    return 0
