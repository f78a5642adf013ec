"""The worked examples (conversation, universal prefix, fleet) come out of the library with
the published numbers."""

from prefixroute.core.reproduce import conversation, isolation, universal_prefix


def test_five_turn_conversation_idealised_reuse():
    result = conversation()
    assert result["reused_tokens_by_turn"] == [0, 500, 800, 1150, 1500]
    assert result["fresh_tokens_by_turn"] == [400, 200, 200, 250, 200]
    assert result["total_reused_tokens"] == 3950
    assert round(result["reuse_fraction"], 4) == 0.7596


def test_five_turn_conversation_through_16_token_blocks():
    result = conversation()
    assert result["full_block_reused_by_turn"] == [0, 496, 784, 1136, 1488]
    assert result["full_block_fresh_by_turn"] == [400, 204, 216, 264, 212]
    assert result["full_block_reused_total"] == 3904
    assert result["full_block_fresh_total"] == 1296
    assert round(result["full_block_reuse_fraction"], 4) == 0.7508


def test_universal_prefix_round_robin_pays_warm_up_on_every_replica():
    result = universal_prefix()
    assert result["round_robin_hits"] == 45
    assert result["single_replica_hits"] == 49
    assert result["warmup_saving_tokens"] == 4 * 200
    assert result["every_request_hits_after_warmup"] is True


def test_isolation_salts_adapters_and_model_revisions_separate_caches():
    result = isolation()
    assert result["cross_tenant_hit_without_salt"] is True
    assert result["cross_tenant_hit_with_distinct_salts"] is False
    assert result["same_tenant_hit_with_salt"] is True
    assert result["model_revision_change_hits"] is False
    assert result["adapter_change_hits"] is False
    assert result["vllm_profile_cross_tenant_hit_with_distinct_salts"] is False
