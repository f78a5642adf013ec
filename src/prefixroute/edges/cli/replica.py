"""``prefixroute replica``: run the engine emulator, a vLLM-compatible replica without a GPU.

It serves vLLM's OpenAI API (completions and chat, streaming or not, with
``usage.prompt_tokens_details.cached_tokens``), ``/metrics`` under vLLM's names and KV events
over ZMQ in vLLM 0.32's format, from a paged prefix cache with vLLM's semantics and a
continuous-batching engine timed by a service-time profile. See docs/emulator.md.
"""

from __future__ import annotations

import argparse
import logging

from prefixroute.core.errors import ConfigError
from prefixroute.core.replica.engine import SCHEDULING_POLICIES
from prefixroute.edges.cli.common import non_negative_float, positive_int


def _lora_module(text: str) -> tuple[str, str]:
    from prefixroute.edges.emulator.protocol import parse_lora_module

    try:
        return parse_lora_module(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {value}")
    return value


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "replica", help="run the engine emulator (a vLLM-compatible replica without a GPU)",
        description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=_port, required=True, help="port to listen on")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: local only)")
    p.add_argument("--block-size", type=positive_int, default=16,
                   help="tokens per KV block (default 16, vLLM's GPU default; the vLLM CPU "
                        "backend needs multiples of 32)")
    capacity = p.add_argument_group("KV capacity (default: the profile's KV memory)")
    capacity.add_argument("--num-blocks", type=positive_int, metavar="N",
                          help="physical KV blocks, block 0 reserved as in vLLM (like "
                               "--num-gpu-blocks-override)")
    capacity.add_argument("--kv-memory-gib", type=non_negative_float, metavar="X",
                          help="KV memory in GiB, converted with --model-config")
    capacity.add_argument("--model-config", metavar="FILE",
                          help="model shape: a preset (llama-3-8b, llama-3-70b, qwen2.5-7b, "
                               "tiny) or a JSON/YAML/HF config.json")
    p.add_argument("--profile", default="llama-3-8b-h100", metavar="NAME|FILE",
                   help="service-time profile: a preset (llama-3-8b-h100, "
                        "llama-3-70b-4xh100, instant) or a file from 'prefixroute calibrate' "
                        "(default llama-3-8b-h100)")
    p.add_argument("--time-scale", type=non_negative_float, default=1.0, metavar="F",
                   help="multiply every step duration by F (default 1: real time; 0: no "
                        "waiting at all, cache behaviour only)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="Hugging Face tokenizer directory (tokenizer.json, chat template; "
                        "'prefixroute tokenizer --tiny DIR' makes a small offline one); "
                        "default: a deterministic fallback tokenizer (docs/emulator.md)")
    p.add_argument("--served-model-name", default="emulated", metavar="NAME",
                   help="model name clients use (default 'emulated')")
    p.add_argument("--lora-modules", type=_lora_module, nargs="+", default=[],
                   metavar="NAME=PATH", help="LoRA adapters served under their own model "
                                             "names (ids 1, 2, ... in this order, as vLLM)")
    p.add_argument("--max-model-len", type=positive_int, metavar="N",
                   help="context limit (default min(8192, KV capacity))")
    p.add_argument("--kv-events", metavar="ENDPOINT",
                   help="publish KV events over ZMQ: tcp://*:PORT binds, a concrete "
                        "address connects (vLLM's rule)")
    p.add_argument("--kv-events-format", choices=["tagged", "legacy"], default="tagged",
                   help="tagged maps (vLLM 0.32, default) or legacy positional arrays")
    p.add_argument("--kv-events-topic", default="", metavar="TOPIC",
                   help="ZMQ topic (default empty, vLLM's default)")
    p.add_argument("--kv-events-replay", metavar="ENDPOINT",
                   help="replay socket to bind, e.g. tcp://127.0.0.1:5560")
    p.add_argument("--seed", type=int, default=0,
                   help="shifts where the dummy reply text starts (default 0)")
    p.add_argument("--mm-item-tokens", type=positive_int, default=64, metavar="N",
                   help="placeholder tokens per multimodal item (default 64: a 224x224 image "
                        "in Qwen2-VL)")
    p.add_argument("--max-num-seqs", type=positive_int, default=256,
                   help="running requests at most (vLLM default 256)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=8192,
                   help="tokens per step at most (vLLM default 8192)")
    p.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="waiting-queue order, as vLLM's flag: fcfs (default) or priority (by "
                        "each request's priority field, lower first)")
    p.add_argument("--log-level", default="warning",
                   choices=["debug", "info", "warning", "error"], help="default warning")
    p.set_defaults(handler=run)


def build_config(args):
    from prefixroute.edges.emulator.config import EmulatorConfig

    if args.kv_events_replay and not args.kv_events:
        raise ConfigError("--kv-events-replay needs --kv-events")
    return EmulatorConfig(
        host=args.host, port=args.port, block_size=args.block_size, num_blocks=args.num_blocks,
        kv_memory_gib=args.kv_memory_gib, model_config=args.model_config, profile=args.profile,
        time_scale=args.time_scale, tokenizer=args.tokenizer, kv_events=args.kv_events,
        kv_events_format=args.kv_events_format, kv_events_topic=args.kv_events_topic,
        kv_events_replay=args.kv_events_replay, served_model_name=args.served_model_name,
        max_model_len=args.max_model_len, lora_modules=list(args.lora_modules), seed=args.seed,
        mm_item_tokens=args.mm_item_tokens, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduling_policy=args.scheduling_policy)


def run(args) -> int:
    from prefixroute.edges.emulator.server import serve

    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(build_config(args), log_level=args.log_level)
