"""Emulator fidelity against real vLLM 0.32 (CPU): same workload, same cache, same events.

One real ``vllm serve`` (block size 32, ``--num-gpu-blocks-override 65``: 64 usable blocks,
2,048 tokens, so the workload evicts) and one ``prefixroute replica`` with the same block size,
block count, context limit and tokenizer directory receive the same sequential workload of
token-id prompts: a shared system prefix with different questions, a five-turn conversation
whose prompts grow by each reply, two cache salts, block-aligned repeats, a prefix-cache reset,
a ``kv_cache_report_mode=full`` request, and long prompts that evict. Replies are pinned with
``allowed_token_ids=[REPLY_TOKEN]`` (a vLLM sampling option the emulator honours), so both
engines generate the same tokens and cache the same decode blocks.

Required: equal ``usage.prompt_tokens_details.cached_tokens`` for every request, the same
stream of KV events (BlockStored hashes with parents, BlockRemoved hashes, AllBlocksCleared,
in order) and the same prefix-cache counters.

Run: ``PREFIXROUTE_VLLM_DIR=$(scripts/setup_vllm_cpu.sh) pytest -m vllm tests/real_vllm``.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from prefixroute.core.kvevents import AllBlocksCleared, BlockRemoved, BlockStored
from prefixroute.edges import children
from prefixroute.edges.kvevents.zmq import KVEventSubscriber
from tests.real_vllm.vllm_server import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    SERVED_MODEL_NAME,
    VllmServer,
    cached_tokens,
    free_port,
    install_problem,
    vllm_install_dir,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]  # vLLM starts slowly on a busy machine

NUM_GPU_BLOCKS = 65  # 64 usable blocks: 2,048 tokens, the smallest pool vLLM accepts here
TOPIC = "kv"
FIRST_ID = 6          # ids 0..5 are the tiny tokenizer's special tokens
VOCAB = 4096
REPLY_TOKEN = 77      # every reply is this token repeated (allowed_token_ids=[77])
SALT_A = "fidelity-salt-a"
SALT_B = "fidelity-salt-b"
SETTLE_S = 1.0        # quiet time that ends an event drain


# -- the workload ------------------------------------------------------------------------------
def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_ID, VOCAB) for _ in range(n)]


def workload() -> list[dict]:
    """The requests, in order. ``prompt`` is a token-id list; ``reset`` steps reset the cache.

    Growing conversations append the previous reply (``max_tokens`` x REPLY_TOKEN) and a new
    user turn to the previous prompt, so turn k hits turn k-1's prompt and decode blocks.
    """
    rng = random.Random(20261129)
    steps: list[dict] = []

    def ask(name: str, prompt: list[int], max_tokens: int = 1, salt: str | None = None,
            **extra) -> None:
        steps.append({"name": name, "prompt": prompt, "max_tokens": max_tokens,
                      "cache_salt": salt, "extra": extra})

    system = _tokens(rng, 300)
    for i, n in enumerate((40, 75, 130, 32)):
        ask(f"shared-prefix-{i}", system + _tokens(rng, n), max_tokens=4)
    ask("shared-prefix-repeat", steps[1]["prompt"], max_tokens=4)

    conversation = _tokens(rng, 150)
    replies = [30, 45, 20, 64, 10]
    for turn, reply in enumerate(replies):
        ask(f"conversation-turn-{turn + 1}", list(conversation), max_tokens=reply)
        conversation = conversation + [REPLY_TOKEN] * reply + _tokens(rng, 25 + 17 * turn)

    salted = _tokens(rng, 200)
    ask("salt-none", salted, max_tokens=2)
    ask("salt-a", salted, max_tokens=2, salt=SALT_A)
    ask("salt-a-repeat", salted + _tokens(rng, 40), max_tokens=2, salt=SALT_A)
    ask("salt-b", salted, max_tokens=2, salt=SALT_B)
    ask("salt-none-repeat", salted, max_tokens=2)

    aligned = _tokens(rng, 128)
    ask("aligned-128", aligned)
    ask("aligned-128-repeat", aligned)  # the last block is recomputed and stored again
    ask("full-report", aligned + _tokens(rng, 50), max_tokens=3,
        vllm_xargs={"kv_cache_report_mode": "full"})

    steps.append({"name": "reset", "reset": True})
    ask("after-reset", steps[0]["prompt"], max_tokens=4)

    # Eviction churn: long prompts over a 64-block pool, then revisits of older prefixes.
    long_prompts = [_tokens(rng, n) for n in (700, 900, 650)]
    for i, prompt in enumerate(long_prompts):
        ask(f"evict-{i}", prompt, max_tokens=40)
    ask("revisit-shared-prefix", steps[2]["prompt"], max_tokens=4)
    ask("revisit-evict-0", long_prompts[0] + _tokens(rng, 60), max_tokens=8)
    ask("revisit-evict-2", long_prompts[2], max_tokens=8)
    ask("revisit-conversation", conversation, max_tokens=16)
    ask("big-1800", _tokens(rng, 1800), max_tokens=100)
    ask("after-big", long_prompts[1][:500], max_tokens=5, salt=SALT_B)
    return steps


# -- the two servers ---------------------------------------------------------------------------
def _drain(subscriber: KVEventSubscriber) -> list:
    """Events received until SETTLE_S passes without a batch."""
    events = []
    while True:
        batch = subscriber.get(timeout=SETTLE_S)
        if batch is None:
            return events
        assert batch.missing_before == 0, f"lost KV event batches before seq {batch.seq}"
        events.extend(batch.batch.events)


def _flatten(events) -> list[tuple]:
    out = []
    for event in events:
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            for block_hash in event.block_hashes:
                out.append(("stored", block_hash, parent))
                parent = block_hash
        elif isinstance(event, BlockRemoved):
            out.extend(("removed", h) for h in event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            out.append(("cleared",))
    return out


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def run_workload(url: str, subscriber: KVEventSubscriber) -> dict:
    client = httpx.Client(base_url=url, timeout=300.0)
    results = []
    events_per_step = []
    for step in workload():
        if step.get("reset"):
            response = client.post("/reset_prefix_cache")
            response.raise_for_status()
            results.append({"name": step["name"], "success": response.json()["success"]})
        else:
            body = {"model": SERVED_MODEL_NAME, "prompt": step["prompt"],
                    "max_tokens": step["max_tokens"], "temperature": 0.0,
                    "allowed_token_ids": [REPLY_TOKEN], "ignore_eos": True,
                    "return_token_ids": True, **step["extra"]}
            if step["cache_salt"] is not None:
                body["cache_salt"] = step["cache_salt"]
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, f"{step['name']}: {response.text}"
            data = response.json()
            results.append({"name": step["name"], "cached_tokens": cached_tokens(data),
                            "prompt_tokens": data["usage"]["prompt_tokens"],
                            "completion_tokens": data["usage"]["completion_tokens"],
                            "output": data["choices"][0].get("token_ids")})
        events_per_step.append(_drain(subscriber))
    metrics = client.get("/metrics").text
    client.close()
    info = [line for line in metrics.splitlines() if line.startswith("vllm:cache_config_info{")]
    return {"results": results, "events": events_per_step,
            "queries": _metric(metrics, "vllm:prefix_cache_queries_total"),
            "hits": _metric(metrics, "vllm:prefix_cache_hits_total"),
            "cache_config_info": [dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
                                  for line in info]}


# Requests whose answers are compared by shape (keys, nesting, value types), not by value.
SHAPE_PROBES = [
    ("completion", "POST", "/v1/completions",
     {"model": SERVED_MODEL_NAME, "prompt": [11, 12, 13, 14], "max_tokens": 3}),
    ("completion-token-ids", "POST", "/v1/completions",
     {"model": SERVED_MODEL_NAME, "prompt": [11, 12, 13], "max_tokens": 2,
      "return_token_ids": True}),
    ("completion-batch", "POST", "/v1/completions",
     {"model": SERVED_MODEL_NAME, "prompt": ["hello", "world"], "max_tokens": 2}),
    ("completion-stream", "POST", "/v1/completions",
     {"model": SERVED_MODEL_NAME, "prompt": [11, 12, 13], "max_tokens": 3, "stream": True}),
    ("completion-stream-usage", "POST", "/v1/completions",
     {"model": SERVED_MODEL_NAME, "prompt": [11, 12, 13], "max_tokens": 3, "stream": True,
      "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ("chat", "POST", "/v1/chat/completions",
     {"model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
      "max_tokens": 3}),
    ("chat-stream-usage", "POST", "/v1/chat/completions",
     {"model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
      "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}),
    ("error-unknown-model", "POST", "/v1/completions",
     {"model": "nope", "prompt": "x", "max_tokens": 1}),
    ("error-temperature", "POST", "/v1/completions",
     {"model": SERVED_MODEL_NAME, "prompt": "x", "temperature": -1}),
    ("error-salt", "POST", "/v1/completions",
     {"model": SERVED_MODEL_NAME, "prompt": "x", "cache_salt": ""}),
    ("error-too-long", "POST", "/v1/completions",
     {"model": SERVED_MODEL_NAME, "prompt": [11] * (MAX_MODEL_LEN + 5), "max_tokens": 1}),
    ("error-max-tokens", "POST", "/v1/completions",
     {"model": SERVED_MODEL_NAME, "prompt": "x", "max_tokens": MAX_MODEL_LEN + 1}),
    ("error-empty-chat", "POST", "/v1/chat/completions",
     {"model": SERVED_MODEL_NAME, "messages": []}),
    ("models", "GET", "/v1/models", None),
    ("render", "POST", "/v1/completions/render",
     {"model": SERVED_MODEL_NAME, "prompt": "hello world"}),
    ("render-chat", "POST", "/v1/chat/completions/render",
     {"model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}),
]


def probe_shapes(url: str) -> dict:
    """Status and body (streams: every chunk) of each shape probe."""
    out = {}
    with httpx.Client(base_url=url, timeout=120.0) as client:
        for name, method, path, body in SHAPE_PROBES:
            response = client.request(method, path, json=body)
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                chunks = [line[6:] for line in response.text.splitlines()
                          if line.startswith("data: ")]
                parsed = [json.loads(c) for c in chunks if c != "[DONE]"]
                out[name] = (response.status_code, parsed, chunks[-1])
            else:
                out[name] = (response.status_code, response.json(), None)
    return out


def _save(run: dict, who: str) -> None:
    """Keep what each engine answered, for reading a failure (TMPDIR/emulator-fidelity-*)."""
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"emulator-fidelity-{who}.json"
    path.write_text(json.dumps({"results": run["results"], "shapes": run["shapes"],
                                "events": [_flatten(e) for e in run["events"]],
                                "queries": run["queries"], "hits": run["hits"]}, indent=1))


def _subscriber() -> tuple[KVEventSubscriber, int]:
    port = free_port()
    subscriber = KVEventSubscriber(f"tcp://127.0.0.1:{port}", bind=True, topic=TOPIC).start()
    return subscriber, port


@pytest.fixture(scope="module")
def vllm_run():
    problem = install_problem(vllm_install_dir())
    if problem:
        pytest.skip(problem)
    subscriber, port = _subscriber()
    try:
        with VllmServer(kv_events_port=port, topic=TOPIC,
                        num_gpu_blocks_override=NUM_GPU_BLOCKS,
                        extra_args=("--enable-scale-out",)) as server:  # render endpoints
            run = run_workload(server.url, subscriber)
            run["shapes"] = probe_shapes(server.url)
            _save(run, "vllm")
            yield run
    finally:
        subscriber.stop()


@pytest.fixture(scope="module")
def emulator_run():
    model_dir = vllm_install_dir() / "model"
    if not (model_dir / "tokenizer.json").exists():
        pytest.skip(f"no tokenizer at {model_dir}")
    subscriber, port = _subscriber()
    http_port = free_port()
    replay_port = free_port()  # never one handed out before nor a bound one
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"emulator-fidelity-{http_port}.log",
               "wb")
    process = children.spawn(
        [sys.executable, "-m", "prefixroute", "replica", "--port", str(http_port),
         "--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_GPU_BLOCKS),
         "--max-model-len", str(MAX_MODEL_LEN), "--tokenizer", str(model_dir),
         "--served-model-name", SERVED_MODEL_NAME, "--time-scale", "0",
         "--kv-events", f"tcp://127.0.0.1:{port}", "--kv-events-topic", TOPIC,
         "--kv-events-replay", f"tcp://127.0.0.1:{replay_port}"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, "emulator exited during startup"
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "emulator not healthy after 60 s"
            time.sleep(0.2)
        run = run_workload(url, subscriber)
        run["shapes"] = probe_shapes(url)
        _save(run, "emulator")
        yield run
    finally:
        children.stop(process, timeout=30)
        log.close()
        subscriber.stop()


# -- the comparisons ---------------------------------------------------------------------------
def test_replies_are_pinned_so_both_engines_cache_the_same_decode_blocks(vllm_run,
                                                                          emulator_run):
    for ours, theirs in zip(emulator_run["results"], vllm_run["results"]):
        if "output" in theirs:
            assert theirs["output"] == [REPLY_TOKEN] * theirs["completion_tokens"]
            assert ours["output"] == theirs["output"], ours["name"]
            assert ours["prompt_tokens"] == theirs["prompt_tokens"], ours["name"]


def test_cached_tokens_equal_for_every_request(vllm_run, emulator_run):
    theirs = [(r["name"], r.get("cached_tokens", r.get("success")))
              for r in vllm_run["results"]]
    ours = [(r["name"], r.get("cached_tokens", r.get("success")))
            for r in emulator_run["results"]]
    assert ours == theirs
    assert sum(1 for r in vllm_run["results"] if r.get("cached_tokens")) >= 10  # real hits


def test_kv_event_streams_are_equal(vllm_run, emulator_run):
    theirs = [_flatten(events) for events in vllm_run["events"]]
    ours = [_flatten(events) for events in emulator_run["events"]]
    flat_theirs = [e for step in theirs for e in step]
    flat_ours = [e for step in ours for e in step]
    requests = [r for r in vllm_run["results"] if "cached_tokens" in r]
    print(f"\nfidelity: {len(requests)} requests, vLLM cached tokens "
          f"{sum(r['cached_tokens'] for r in requests)}, emulator "
          f"{sum(r.get('cached_tokens', 0) for r in emulator_run['results'])}; events vLLM "
          f"{sum(1 for e in flat_theirs if e[0] == 'stored')} stored / "
          f"{sum(1 for e in flat_theirs if e[0] == 'removed')} removed / "
          f"{sum(1 for e in flat_theirs if e[0] == 'cleared')} cleared, emulator "
          f"{sum(1 for e in flat_ours if e[0] == 'stored')} / "
          f"{sum(1 for e in flat_ours if e[0] == 'removed')} / "
          f"{sum(1 for e in flat_ours if e[0] == 'cleared')}; counters vLLM "
          f"{vllm_run['queries']:.0f}/{vllm_run['hits']:.0f}, emulator "
          f"{emulator_run['queries']:.0f}/{emulator_run['hits']:.0f}")
    assert any(e[0] == "removed" for e in flat_theirs), "the workload must evict"
    if flat_ours != flat_theirs:
        names = [r["name"] for r in vllm_run["results"]]
        for name, a, b in zip(names, ours, theirs):
            assert a == b, f"first difference at step {name!r}"
    assert flat_ours == flat_theirs


def test_event_batches_carry_the_same_fields(vllm_run, emulator_run):
    def fields(events):
        out = []
        for event in events:
            if isinstance(event, BlockStored):
                out.append(("stored", event.block_hashes, event.parent_block_hash,
                            event.token_ids, event.block_size, event.extra_keys,
                            event.lora_name, event.medium, event.group_idx,
                            event.kv_cache_spec_kind))
            elif isinstance(event, BlockRemoved):
                out.append(("removed", event.block_hashes, event.medium, event.group_idx))
            else:
                out.append(("cleared",))
        return out

    ours = [fields(e) for e in emulator_run["events"]]
    theirs = [fields(e) for e in vllm_run["events"]]
    assert [e for s in ours for e in s] == [e for s in theirs for e in s]


def test_prefix_cache_counters_are_equal(vllm_run, emulator_run):
    assert (emulator_run["queries"], emulator_run["hits"]) == \
        (vllm_run["queries"], vllm_run["hits"])


def cpu_build_resets_the_ssm_cache_dtype() -> bool:
    """vLLM's CPU platform replaces an "auto" ``mamba_ssm_cache_dtype`` with "float32" for
    every model when ``torch.cpu._is_avx512_bf16_supported()`` (its accelerated GDN check in
    ``CpuPlatform.check_and_update_config``): a property of the host CPU, not of the model or
    of any package version. Asked of the install's own torch, as vLLM asks it."""
    python = vllm_install_dir() / "venv" / "bin" / "python"
    done = subprocess.run([str(python), "-c", "import torch; "
                           "print(torch.cpu._is_avx512_bf16_supported())"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip() == "True"


def test_cache_config_info_has_vllms_labels_and_values(vllm_run, emulator_run):
    theirs, = vllm_run["cache_config_info"]
    ours, = emulator_run["cache_config_info"]
    assert list(ours) == list(theirs)  # same label names in the same order
    assert theirs["num_gpu_blocks"] == str(NUM_GPU_BLOCKS)
    # The emulator reports what a GPU server reports; the CPU build differs on two labels.
    # It sizes KV from VLLM_CPU_KVCACHE_SPACE (1 GiB here) where the emulator was given a
    # block count, as a GPU server with --num-gpu-blocks-override reports "None".
    platform_labels = {"kv_cache_memory_bytes"}
    if ours["mamba_ssm_cache_dtype"] == "auto" and cpu_build_resets_the_ssm_cache_dtype():
        assert theirs["mamba_ssm_cache_dtype"] == "float32"
        platform_labels.add("mamba_ssm_cache_dtype")
    differ = {k for k in theirs if ours[k] != theirs[k]}
    assert differ <= platform_labels, {k: (ours[k], theirs[k]) for k in differ}


# -- API shapes ---------------------------------------------------------------------------------
def shape(value):
    """Keys, nesting and value types; lists by their first element."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


@pytest.mark.parametrize("name", [p[0] for p in SHAPE_PROBES])
def test_answers_have_vllms_shape(vllm_run, emulator_run, name):
    status, theirs, last = vllm_run["shapes"][name]
    our_status, ours, our_last = emulator_run["shapes"][name]
    assert our_status == status
    assert our_last == last  # streams end with "data: [DONE]"
    if name == "models":  # the emulator's model card has no vLLM-specific root path
        theirs = theirs["data"][0].keys()
        ours = ours["data"][0].keys()
        assert ours == theirs
        return
    if isinstance(theirs, list) and name.endswith(("stream", "stream-usage")):
        assert [shape(c) for c in ours] == [shape(c) for c in theirs]
        return
    assert shape(ours) == shape(theirs)
    if name == "render":  # same tokenizer directory, same tokens (BOS included)
        assert ours[0]["token_ids"] == theirs[0]["token_ids"]
    if name == "render-chat":  # same chat template
        assert ours["token_ids"] == theirs["token_ids"]
        assert ours["sampling_params"] == theirs["sampling_params"]
    if name.startswith("error"):
        assert ours["error"]["type"] == theirs["error"]["type"]
        assert ours["error"]["param"] == theirs["error"]["param"]
        assert ours["error"]["message"].split(" (parameter")[0] == \
            theirs["error"]["message"].split(" (parameter")[0]
