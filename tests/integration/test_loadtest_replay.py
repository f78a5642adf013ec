"""The load generator's open-loop replay over several URLs, against two real emulator
processes: taking turns, or each request to the URL ``pick`` names (a balancer with tenant
affinity in front of several gateways).

Each tenant sends one fixed 100-token prompt four times, so a repeat that lands where the
prompt went before reuses 96 tokens (``floor(99 / 16) * 16``) and one that lands elsewhere
none: the cached tokens show where each request went.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from prefixroute.edges.emulator.process import EmulatorProcess
from prefixroute.edges.loadtest.replay import replay
from prefixroute.edges.loadtest.workload import WireRequest

MODEL = "tiny"
EMULATOR = ["--block-size", "16", "--num-blocks", "64", "--time-scale", "0",
            "--served-model-name", MODEL]


@pytest.fixture(scope="module")
def urls():
    with EmulatorProcess(EMULATOR) as first, EmulatorProcess(EMULATOR) as second:
        yield [first.url + "/v1/completions", second.url + "/v1/completions"]


def requests(tenants: str) -> list[WireRequest]:
    """One request per letter of ``tenants``, 50 ms apart; tenant ``a``'s prompt differs
    from ``b``'s from the first token."""
    out = []
    for i, tenant in enumerate(tenants):
        prompt = [ord(tenant) * 7 + j for j in range(100)]
        body = orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2,
                             "stream": True,
                             "stream_options": {"include_usage": True}})
        out.append(WireRequest(i, i * 0.05, tenant, 100, 2, body))
    return out


def cached(urls, tenants: str, pick=None) -> list[int | None]:
    outcomes = asyncio.run(replay(urls, requests(tenants), headers_for=lambda r: {},
                                  deadline_s=30.0, pick=pick))
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    return [o.cached_tokens for o in outcomes]


def by_tenant(slot: int, request: WireRequest) -> int:
    return 0 if request.tenant == "a" else 1


def test_by_tenant_every_repeat_finds_its_prompt(urls):
    assert cached(urls, "aabbaabb", pick=by_tenant) == [0, 96, 0, 96, 96, 96, 96, 96]


def test_taking_turns_a_tenants_second_request_goes_to_the_other_url(urls):
    # Tenants c and d (prompts new to both emulators): c at slots 0, 1, 4, 5 goes to
    # URLs 0, 1, 0, 1; d at slots 2, 3, 6, 7 likewise.
    assert cached(urls, "ccddccdd") == [0, 0, 0, 0, 96, 96, 96, 96]
