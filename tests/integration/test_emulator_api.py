"""The emulator's OpenAI API over real sockets, driven by the official ``openai`` client.

One emulator process (``prefixroute replica``, time model off, block size 16, 64 blocks, the
test tokenizer with its chat template, one LoRA adapter) serves the whole module. Expected
cached tokens follow vLLM's rule: ``floor((n - 1) / 16) * 16`` on a full repeat of n tokens.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from prefixroute.edges.emulator.process import EmulatorProcess

BLOCK = 16
MODEL = "tiny"
ADAPTER = "tenant-adapter"


@pytest.fixture(scope="module")
def emulator(tiny_tokenizer_dir):
    with EmulatorProcess(["--block-size", str(BLOCK), "--num-blocks", "64",
                          "--time-scale", "0", "--tokenizer", str(tiny_tokenizer_dir),
                          "--served-model-name", MODEL,
                          "--lora-modules", f"{ADAPTER}=/adapters/tenant"]) as process:
        yield process


@pytest.fixture
def client(emulator):
    with openai.OpenAI(base_url=emulator.url + "/v1", api_key="unused",
                       max_retries=0) as c:
        yield c


def prompt_ids(seed: int, n: int) -> list[int]:
    return [10 + (seed * 131 + i * 17) % 1900 for i in range(n)]


def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


# -- completions ---------------------------------------------------------------------------
def test_completion_reports_usage_and_generates_max_tokens(client):
    response = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=7)
    choice = response.choices[0]
    assert response.object == "text_completion"
    assert choice.finish_reason == "length" and choice.text
    assert response.usage.completion_tokens == 7
    assert response.usage.total_tokens == response.usage.prompt_tokens + 7


def test_a_repeated_prompt_hits_all_but_its_last_partial_block(client):
    prompt = prompt_ids(1, 100)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert cached(first.usage) == 0
    assert cached(second.usage) == 96  # floor(99 / 16) * 16


def test_a_block_aligned_repeat_recomputes_its_last_block(client):
    prompt = prompt_ids(2, 64)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert cached(again.usage) == 48  # floor(63 / 16) * 16


def test_cache_salts_keep_tenants_apart(client):
    prompt = prompt_ids(3, 80)

    def run(salt):
        extra = {"cache_salt": salt} if salt else {}
        return cached(client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                                extra_body=extra).usage)

    assert run("tenant-a") == 0
    assert run("tenant-b") == 0
    assert run(None) == 0
    assert run("tenant-a") == 64
    assert run("tenant-b") == 64


def test_an_adapter_has_its_own_cache(client):
    prompt = prompt_ids(4, 50)
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    adapter = client.completions.create(model=ADAPTER, prompt=prompt, max_tokens=1)
    adapter_again = client.completions.create(model=ADAPTER, prompt=prompt, max_tokens=1)
    assert adapter.model == ADAPTER
    assert (cached(base.usage), cached(adapter.usage), cached(adapter_again.usage)) == (0, 0, 48)


def test_decode_blocks_are_cached_so_the_next_turn_hits_the_reply(client):
    prompt = prompt_ids(5, 40)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30,
                                      extra_body={"return_token_ids": True})
    reply = first.choices[0].model_extra["token_ids"]
    assert len(reply) == 30
    follow_up = prompt + reply + prompt_ids(6, 10)
    second = client.completions.create(model=MODEL, prompt=follow_up, max_tokens=1)
    # 40 + 30 - 1 = 69 tokens had KV: 4 full blocks = 64 tokens.
    assert cached(second.usage) == 64


def test_allowed_token_ids_pin_the_reply(client):
    response = client.completions.create(model=MODEL, prompt=prompt_ids(7, 20), max_tokens=5,
                                         extra_body={"allowed_token_ids": [42],
                                                     "return_token_ids": True})
    assert response.choices[0].model_extra["token_ids"] == [42] * 5


def test_a_batch_of_prompts_gets_one_choice_each(client):
    response = client.completions.create(model=MODEL, prompt=["x = 1", "y = 2", "z = 3"],
                                         max_tokens=2)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert response.usage.completion_tokens == 6


def test_streamed_completion_matches_the_plain_one(client):
    prompt = prompt_ids(8, 30)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                            stream=True,
                                            stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) == 6  # one token per chunk, as vLLM streams
    assert "".join(c.choices[0].text for c in text_chunks) == plain.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 6
    assert cached(usage) == 16  # the plain request cached floor(29/16) = 1 block


# -- chat ----------------------------------------------------------------------------------
def test_chat_renders_the_template_and_caches_the_conversation(client):
    messages = [{"role": "system", "content": "You answer in Python."},
                {"role": "user", "content": "Write a function that adds two numbers. " * 6}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].message.content
    n = first.usage.prompt_tokens
    assert cached(second.usage) == (n - 1) // BLOCK * BLOCK > 0


def test_chat_without_max_tokens_stops_after_the_dummy_reply(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}])
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == 16


def test_streamed_chat_starts_with_the_role_and_ends_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stream please"}], max_tokens=3,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    contents = [c.choices[0].delta.content for c in chunks[1:] if c.choices]
    assert len(contents) == 3 and all(contents)
    assert chunks[-1].usage.completion_tokens == 3


def test_images_are_cached_by_identity(client):
    def ask(uuid):
        content = [{"type": "text", "text": "Describe this picture."},
                   {"type": "image_url", "image_url": {"url": "https://example.com/a.png"},
                    "uuid": uuid}]
        response = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=1)
        return response.usage

    first = ask("image-1")
    again = ask("image-1")
    other = ask("image-2")
    assert first.prompt_tokens > 64  # 64 placeholder tokens for the image
    assert cached(first) == 0
    assert cached(again) == (first.prompt_tokens - 1) // BLOCK * BLOCK
    # The image starts in block 0: another identity changes every block from there.
    assert cached(other) == 0


# -- errors --------------------------------------------------------------------------------
def test_an_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert error.value.body["param"] == "model"


def test_bad_sampling_values_are_400(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, temperature=-1)
    assert "temperature must be non-negative" in error.value.message


def test_a_prompt_longer_than_the_context_is_400(client):
    # 64 blocks of 16: a 1,008-token context (block 0 reserved).
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt=prompt_ids(9, 1100), max_tokens=1)
    assert "maximum context length is 1008 tokens" in error.value.message


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, "body"),
    (b'{"model": "tiny"}', 400, "prompt"),
    (b'{"model": "tiny", "prompt": "x", "cache_salt": ""}', 400, "cache_salt"),
    (b'{"model": "tiny", "prompt": "x", "cache_salt": "a/b"}', 400, "cache_salt"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": "x", "stream_options": {"include_usage": true}}', 400,
     "stream_options"),
    (b'{"model": "tiny", "prompt": [1, 99999]}', 400, None),
])
def test_bad_bodies_get_an_openai_error_object(emulator, body, status, param):
    response = httpx.post(emulator.url + "/v1/completions", content=body,
                          headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param and error["message"]


def test_bad_chat_messages_are_400(emulator):
    for messages in ("hi", [], [{"content": "no role"}],
                     [{"role": "user", "content": [{"type": "video_game"}]}]):
        response = httpx.post(emulator.url + "/v1/chat/completions",
                              json={"model": MODEL, "messages": messages})
        assert response.status_code == 400, messages
        assert response.json()["error"]["code"] == 400


# -- the other endpoints -------------------------------------------------------------------
def test_models_lists_the_base_model_and_the_adapter(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL, ADAPTER]


def test_unknown_routes_and_methods_answer_like_fastapi(emulator):
    assert httpx.get(emulator.url + "/v1/nothing").json() == {"detail": "Not Found"}
    response = httpx.get(emulator.url + "/v1/completions")
    assert response.status_code == 405 and response.json() == {"detail": "Method Not Allowed"}


def test_health_and_version(emulator):
    assert httpx.get(emulator.url + "/health").status_code == 200
    assert httpx.get(emulator.url + "/version").json()["version"] == "0.32.0"


def test_metrics_use_vllm_names_and_count_tokens(emulator, client):
    def sample(text, name):
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{"))

    before = httpx.get(emulator.url + "/metrics").text
    prompt = prompt_ids(10, 40)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    after = httpx.get(emulator.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_success_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert name + "{" in after, name
    assert sample(after, "vllm:prefix_cache_queries_total") \
        - sample(before, "vllm:prefix_cache_queries_total") == 80
    assert sample(after, "vllm:prefix_cache_hits_total") \
        - sample(before, "vllm:prefix_cache_hits_total") == 32
    assert 'model_name="tiny"' in after and 'engine="0"' in after
    info = [line for line in after.splitlines() if line.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and info[0].endswith("} 1.0")
    for label in ('block_size="16"', 'num_gpu_blocks="64"', 'enable_prefix_caching="True"',
                  'prefix_caching_hash_algo="sha256"'):
        assert label in info[0], label


def test_render_returns_the_engine_token_ids(emulator, client):
    rendered = httpx.post(emulator.url + "/v1/completions/render",
                          json={"model": MODEL, "prompt": [5, 6, 7]}).json()
    assert rendered[0]["token_ids"] == [5, 6, 7]
    text = httpx.post(emulator.url + "/v1/completions/render",
                      json={"model": MODEL, "prompt": "x = 1"}).json()[0]["token_ids"]
    response = client.completions.create(model=MODEL, prompt="x = 1", max_tokens=1,
                                         extra_body={"return_token_ids": True})
    assert response.choices[0].model_extra["prompt_token_ids"] == text


def test_reset_prefix_cache_forgets_every_block(emulator, client):
    prompt = prompt_ids(11, 40)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert httpx.post(emulator.url + "/reset_prefix_cache").json() == {"success": True}
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert cached(again.usage) == 0
