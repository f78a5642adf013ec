"""Block keys come from one function, and mean "same prefix up to here"."""

from array import array

from prefixroute.core.identity.hashing import BlockHasher
from prefixroute.core.identity.identity import CacheIdentity
from prefixroute.core.simulator.keys import BlockKeyer
from prefixroute.core.simulator.request import Request


def tokens(n, start=1):
    return array("I", range(start, start + n))


def test_token_keys_are_the_native_block_hashes_of_full_blocks():
    request = Request("r", 0.0, 40, 1, 16, token_ids=tokens(40))
    expected = BlockHasher("native", block_size=16).block_hashes(tokens(40))
    assert BlockKeyer().keys(request) == expected
    assert len(expected) == 2  # 40 tokens: two full blocks, the partial third has no key


def test_a_declared_group_prefix_hashes_once_and_gives_the_same_keys():
    prefix = tokens(64)
    keyer = BlockKeyer()
    plain = BlockKeyer()
    for i in range(3):
        prompt = prefix + tokens(20, start=1000 * (i + 1))
        with_hint = Request(f"r{i}", 0.0, 84, 1, 16, token_ids=prompt, prefix_group="g",
                            prefix_tokens=64)
        without = Request(f"r{i}", 0.0, 84, 1, 16, token_ids=prompt)
        assert keyer.keys(with_hint) == plain.keys(without)


def test_identity_changes_every_key():
    a = Request("a", 0.0, 32, 1, 16, token_ids=tokens(32))
    b = Request("b", 0.0, 32, 1, 16, token_ids=tokens(32),
                identity=CacheIdentity(cache_salt="tenant-b"))
    ka, kb = BlockKeyer().keys(a), BlockKeyer().keys(b)
    assert all(x != y for x, y in zip(ka, kb))


def test_block_ids_chain_and_namespaces_keep_files_apart():
    keyer = BlockKeyer()
    first = Request("1", 0.0, 130, 1, 64, hash_ids=[1, 2, 3], namespace="file-a")
    second = Request("2", 0.0, 200, 1, 64, hash_ids=[1, 2, 9, 4], namespace="file-a")
    other = Request("3", 0.0, 130, 1, 64, hash_ids=[1, 2, 3], namespace="file-b")
    k1, k2, k3 = keyer.keys(first), keyer.keys(second), keyer.keys(other)
    assert len(k1) == 2 and len(k2) == 3  # full blocks only: 130 // 64, 200 // 64
    assert k1 == k2[:2] and k2[2] != k1[-1]
    assert k3[0] != k1[0]


def test_a_known_reply_extends_the_keys_except_its_last_token():
    # prompt 20 tokens + reply 13 tokens: KV exists for 32 tokens -> 2 full blocks
    request = Request("r", 0.0, 20, 13, 16, token_ids=tokens(20),
                      output_token_ids=tokens(13, start=500))
    keys = BlockKeyer().keys(request)
    expected = BlockHasher("native", block_size=16).block_hashes(
        tokens(20) + tokens(12, start=500))
    assert keys == expected and len(keys) == 2


def test_a_gateway_hashing_the_same_tokens_gets_the_simulators_keys():
    from prefixroute.core.simulator.keys import token_block_keys
    identity = CacheIdentity(model="m", cache_salt="s")
    request = Request("r", 0.0, 50, 1, 16, token_ids=tokens(50), identity=identity)
    assert token_block_keys(list(tokens(50)), 16, identity) == BlockKeyer().keys(request)
