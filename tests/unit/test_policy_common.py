"""Peer policies share helpers through ``policies/common.py``, never through each other."""

from __future__ import annotations

import ast
from pathlib import Path

import prefixroute.core.routing.policies as policies_package
from prefixroute.core.routing.base import RequestView
from prefixroute.core.routing.policies.common import expected_cached_tokens

POLICIES = Path(policies_package.__file__).parent
NOT_POLICIES = {"__init__", "common"}


def test_no_policy_imports_from_a_peer_policy():
    peers = {p.stem for p in POLICIES.glob("*.py")} - NOT_POLICIES
    offenders = []
    for path in sorted(POLICIES.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if parts[:-1] == ["prefixroute", "core", "routing", "policies"] \
                        and parts[-1] in peers:
                    offenders.append(f"{path.name} imports {parts[-1]}")
    assert offenders == []


def request(num_tokens: int, block_size: int = 16) -> RequestView:
    return RequestView(request_id="r", num_tokens=num_tokens, block_size=block_size,
                       block_keys=[f"b{i}" for i in range(num_tokens // block_size)])


def test_expected_cached_tokens_never_counts_the_last_prompt_token():
    assert expected_cached_tokens(request(48), 3, 16) == 32   # floor(47 / 16) * 16
    assert expected_cached_tokens(request(49), 3, 16) == 48   # the 49th token is recomputed


def test_expected_cached_tokens_counts_token_units_in_whole_blocks_only():
    # 40 matched tokens of a 100-token prompt: 2 whole 16-token blocks.
    assert expected_cached_tokens(request(100), 40, 1) == 32
