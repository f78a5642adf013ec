"""The emulator's HTTP server: vLLM's OpenAI-compatible API on Starlette + uvicorn.

Routes (as ``vllm serve`` 0.32 has them, plus the probes peer routers send):

``POST /v1/completions``, ``POST /v1/chat/completions``
    streaming (SSE, ``data: [DONE]``) or not; ``usage.prompt_tokens_details.cached_tokens``
``POST /v1/completions/render``, ``POST /v1/chat/completions/render``
    the token ids the engine would run (vLLM needs ``--enable-scale-out`` for these; the
    emulator always serves them)
``GET /v1/models``, ``GET /health``, ``GET /version``, ``GET /metrics``
``POST /reset_prefix_cache``
    vLLM needs ``VLLM_SERVER_DEV_MODE=1``; always on here. Answers ``{"success": bool}``.
``GET /model_info``, ``GET /server_info``
    what ``sglang-router`` probes
``GET /debug/timings``, ``DELETE /debug/timings``
    only with ``PREFIXROUTE_EMULATOR_TIMINGS=N`` set: per-request arrival and first-write
    times (timings.py)

:class:`EmulatorServer` holds the pieces (tokenizer, replica, driver, metrics, KV publisher)
and builds the Starlette app; :func:`serve` runs it under uvicorn with uvloop and httptools.

Clients that leave: as vLLM (``with_cancellation``), a non-streaming request listens for the
client's ``http.disconnect`` while its sequences run and aborts them in the engine when it
comes; a stream aborts its unfinished sequences whenever its response ends early (the client
closed it, a write failed, or the handler was cancelled).

Shutdown: on SIGTERM or SIGINT uvicorn stops accepting connections and then waits for the
requests in flight. The emulator first aborts every sequence in the engine (as vLLM's default
``shutdown_timeout=0`` does: "abort" mode) and fails their requests with a 503, so each
handler answers at once and the server exits within a fraction of a second instead of
waiting for the engine to serve them; requests that arrive later get a 503 too, and
``SHUTDOWN_GRACE_S`` bounds whatever else is still running (e.g. a client that stopped
reading).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import sys
import time
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from prefixroute import __version__
from prefixroute.core.errors import ConfigError, InputError
from prefixroute.core.identity.identity import Adapter, CacheIdentity
from prefixroute.core.replica.service_time import INSTANT
from prefixroute.edges.emulator import protocol
from prefixroute.edges.emulator.config import (
    GIB,
    EmulatorConfig,
    resolve_max_model_len,
    resolve_num_blocks,
    served_model_config,
)
from prefixroute.edges.emulator.driver import EngineDriver, EngineSequence
from prefixroute.edges.emulator.metrics import CONTENT_TYPE, EmulatorMetrics, cache_config_info
from prefixroute.edges.emulator.protocol import (
    SSE_DONE,
    APIError,
    GenerationRequest,
    ServedModels,
    dumps,
    loads,
    sse,
)
from prefixroute.edges.emulator.replica import EmulatedReplica, SequenceMeta
from prefixroute.edges.emulator.timings import TimingMiddleware, TimingRecords, capacity_from_env
from prefixroute.edges.emulator.tokens import DummyOutput, PromptEncoder
from prefixroute.edges.listen import bind_socket, listen_url
from prefixroute.edges.profiles import load_profile

log = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"  # the vLLM release whose API and events the emulator follows
_JSON = "application/json"
_SSE = "text/event-stream; charset=utf-8"
SHUTDOWN_GRACE_S = 3.0  # uvicorn's timeout_graceful_shutdown: then remaining handlers are cancelled


def shutdown_error() -> APIError:
    return APIError("the server is shutting down; the request was aborted", status=503,
                    err_type="ServiceUnavailableError")


async def _client_gone(receive) -> None:
    """Return when the client disconnects (the request body was read already, so every
    message left is ``http.disconnect``)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class _EngineStream(StreamingResponse):
    """A streamed answer that aborts its unfinished engine sequences however it ends early:
    the client closed the stream, a write failed, or the handler was cancelled (even before
    the body iterator started, when the generator's own ``finally`` would never run)."""

    def __init__(self, content, driver: EngineDriver, sequences: list[EngineSequence]):
        super().__init__(content, media_type=_SSE)
        self._driver = driver
        self._sequences = sequences

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for seq in self._sequences:
                if not seq.done.done():
                    self._driver.abort(seq)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Unknown routes and methods answer as FastAPI (and so vLLM) does: ``{"detail": ...}``."""
    return Response(dumps({"detail": exc.detail}), status_code=exc.status_code,
                    media_type=_JSON, headers=exc.headers)


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status_code=status, media_type=_JSON)


def error_response(error: APIError) -> Response:
    return json_response(error.body(), error.status)


class EmulatorServer:
    """Everything one emulated replica serves, independent of how it is run."""

    def __init__(self, config: EmulatorConfig):
        self.config = config
        profile = load_profile(config.profile, "--profile")
        if config.time_scale < 0:
            raise ConfigError(f"--time-scale must be >= 0, got {config.time_scale}")
        self.profile = profile
        self.service = INSTANT if config.time_scale == 0 else profile.scaled(config.time_scale)
        self.num_blocks, self.capacity_source = resolve_num_blocks(config, profile)
        self.max_model_len = resolve_max_model_len(config, self.num_blocks)
        if config.kv_events_format not in ("tagged", "legacy"):
            raise ConfigError(f"--kv-events-format must be tagged or legacy, got "
                              f"{config.kv_events_format!r}")
        self.encoder = PromptEncoder(config.tokenizer, mm_item_tokens=config.mm_item_tokens)
        self.vocab_size = None if self.encoder.fallback else \
            self.encoder.tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
        self.dummy = DummyOutput(self.encoder, config.seed)
        self.replica = EmulatedReplica(
            num_blocks=self.num_blocks, block_size=config.block_size, service=self.service,
            hash_algo=config.hash_algo, none_hash_seed=os.environ.get("PYTHONHASHSEED"),
            record_events=config.kv_events is not None,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, scheduling_policy=config.scheduling_policy)
        self.models = ServedModels(config.served_model_name,
                                   str(config.tokenizer or "prefixroute-emulator"),
                                   self.max_model_len)
        for lora_id, (name, path) in enumerate(config.lora_modules, start=1):
            if name == config.served_model_name or name in self.models.adapters:
                raise ConfigError(f"--lora-modules: duplicate model name {name!r}")
            self.models.adapters[name] = (Adapter(name, path), lora_id)
        self.metrics = EmulatorMetrics(self.replica.engine, config.served_model_name,
                                       self.max_model_len, cache_info=cache_config_info(
            block_size=config.block_size, num_gpu_blocks=self.num_blocks,
            max_model_len=self.max_model_len, hash_algo=config.hash_algo,
            num_gpu_blocks_override=config.num_blocks,
            kv_cache_memory_bytes=(int(config.kv_memory_gib * GIB)
                                   if config.kv_memory_gib is not None else None),
            hf_config=served_model_config(config)))
        self.publisher = None
        self.driver = EngineDriver(self.replica, self.metrics, publish=self._publish)
        self._identities: dict[tuple, CacheIdentity] = {}
        self._id_prefix = secrets.token_hex(4)
        self._counter = itertools.count()
        self.shutting_down = False
        capacity = capacity_from_env()  # opt-in per-request timings (timings.py)
        self.timings = TimingRecords(capacity) if capacity else None

    def begin_shutdown(self) -> int:
        """Refuse new requests and abort every sequence in the engine, failing their
        requests with a 503 so their handlers answer now. Returns the sequences aborted."""
        self.shutting_down = True
        return self.driver.abort_all(shutdown_error())

    # -- lifecycle ----------------------------------------------------------------------------
    def start_kv_events(self) -> None:
        """Open the ZMQ publisher (vLLM's rule: bind wildcard endpoints, connect to concrete
        ones) and the replay socket."""
        if self.config.kv_events is None or self.publisher is not None:
            return
        from prefixroute.edges.kvevents.zmq import KVEventPublisher

        wire = "positional" if self.config.kv_events_format == "legacy" else "tagged"
        self.publisher = KVEventPublisher(self.config.kv_events,
                                          replay_endpoint=self.config.kv_events_replay,
                                          topic=self.config.kv_events_topic, wire_format=wire)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    def _publish(self, batch) -> None:
        if self.publisher is not None:
            self.publisher.publish(batch)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.start_kv_events()
        try:
            yield
        finally:
            self.close()

    def app(self) -> Starlette:
        debug = [] if self.timings is None else [
            Route("/debug/timings", self.debug_timings, methods=["GET", "DELETE"])]
        middleware = [] if self.timings is None else [
            Middleware(TimingMiddleware, records=self.timings)]
        return Starlette(middleware=middleware, routes=[*debug,
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions/render", self.render_completions, methods=["POST"]),
            Route("/v1/chat/completions/render", self.render_chat, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ping", self.health, methods=["GET", "POST"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]),
            Route("/model_info", self.model_info, methods=["GET"]),
            Route("/get_model_info", self.model_info, methods=["GET"]),
            Route("/server_info", self.server_info, methods=["GET"]),
            Route("/get_server_info", self.server_info, methods=["GET"]),
        ], lifespan=self.lifespan, exception_handlers={HTTPException: _http_error})

    # -- small endpoints ------------------------------------------------------------------------
    async def debug_timings(self, request: Request) -> Response:
        """Opt-in per-request timing records (timings.py); DELETE empties them."""
        assert self.timings is not None
        if request.method == "DELETE":
            self.timings.clear()
            return json_response({"cleared": True})
        return json_response(self.timings.as_json())

    async def health(self, request: Request) -> Response:
        return Response(b"", status_code=200)

    async def version(self, request: Request) -> Response:
        return json_response({"version": VLLM_VERSION, "emulator": f"prefixroute {__version__}"})

    async def list_models(self, request: Request) -> Response:
        return json_response(self.models.listing())

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def reset_prefix_cache(self, request: Request) -> Response:
        return json_response({"success": self.driver.reset_prefix_cache()})

    async def model_info(self, request: Request) -> Response:
        return json_response({"model_path": self.models.root,
                              "tokenizer_path": self.config.tokenizer,
                              "is_generation": True, "served_model_name": self.models.name,
                              "max_model_len": self.max_model_len})

    async def server_info(self, request: Request) -> Response:
        engine = self.replica.engine
        return json_response({
            "emulator": f"prefixroute {__version__}", "vllm_version": VLLM_VERSION,
            "served_model_name": self.models.name, "block_size": self.config.block_size,
            "num_gpu_blocks": self.num_blocks, "kv_capacity": self.capacity_source,
            "max_model_len": self.max_model_len, "profile": self.service.name,
            "time_scale": self.config.time_scale, "tokenizer": self.encoder.description,
            "kv_events": self.config.kv_events, "num_requests_running": engine.running,
            "num_requests_waiting": engine.waiting, "kv_cache_usage_perc": engine.kv_usage})

    # -- parsing --------------------------------------------------------------------------------
    async def _parse(self, request: Request, kind: str) -> GenerationRequest:
        raw = await request.body()
        try:
            body = loads(raw)
        except protocol.JSONDecodeError as exc:
            raise APIError(f"JSON decode error: {exc}", err_type="Bad Request",
                           param="body") from None
        parse = protocol.parse_chat if kind == "chat" else protocol.parse_completion
        try:
            return parse(body, self.models, self.encoder, self.vocab_size)
        except InputError as exc:  # the chat template failed, or a tokenizer error
            raise APIError(str(exc)) from None

    def _identity(self, generation: GenerationRequest) -> CacheIdentity:
        key = (generation.cache_salt, generation.adapter)
        identity = self._identities.get(key)
        if identity is None:
            identity = CacheIdentity(adapter=generation.adapter,
                                     cache_salt=generation.cache_salt)
            if len(self._identities) < 10_000:
                self._identities[key] = identity
        return identity

    def _response_id(self, prefix: str) -> str:
        return f"{prefix}-{self._id_prefix}{next(self._counter):08x}"

    def _submit(self, generation: GenerationRequest) -> list[EngineSequence]:
        if self.shutting_down:
            raise shutdown_error()
        identity = self._identity(generation)
        sequences = []
        for prompt, max_tokens in zip(generation.prompts, generation.max_tokens):
            meta = SequenceMeta(identity, tuple(prompt.media), generation.lora_id,
                                generation.session_id, generation.report_full,
                                generation.priority)
            output_ids = self.dummy.token_ids(max_tokens, generation.allowed_token_ids)
            sequences.append(self.driver.submit(prompt.token_ids, output_ids, meta))
        return sequences

    # -- generation -----------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _generate(self, request: Request, kind: str) -> Response:
        try:
            generation = await self._parse(request, kind)
            sequences = self._submit(generation)
        except APIError as error:
            return error_response(error)
        if generation.stream:
            return _EngineStream(self._stream(generation, sequences), self.driver, sequences)
        if not await self._finished_or_gone(request, sequences):
            return Response(b"", status_code=499)  # nobody is there to read it
        try:
            for seq in sequences:
                seq.done.result()
        except APIError as error:
            self._abort_unfinished(sequences)
            return error_response(error)
        return json_response(self._body(generation, sequences))

    async def _finished_or_gone(self, request: Request,
                                sequences: list[EngineSequence]) -> bool:
        """Wait until every sequence has ended (finished, rejected or aborted): True; or
        until the client disconnects: its sequences are aborted in the engine, False (vLLM's
        ``with_cancellation``). An instant engine has answered already: no waiting."""
        waiting = [seq.done for seq in sequences if not seq.done.done()]
        if not waiting:
            return True
        gone = asyncio.ensure_future(_client_gone(request.receive))
        try:
            while True:
                await asyncio.wait((*waiting, gone), return_when=asyncio.FIRST_COMPLETED)
                waiting = [seq.done for seq in sequences if not seq.done.done()]
                if not waiting:
                    return True
                if gone.done():
                    self._abort_unfinished(sequences)
                    return False
        except BaseException:  # cancelled (e.g. a forced shutdown): leave nothing running
            self._abort_unfinished(sequences)
            raise
        finally:
            gone.cancel()

    def _abort_unfinished(self, sequences: list[EngineSequence]) -> None:
        for seq in sequences:
            if not seq.done.done():
                self.driver.abort(seq)

    def _record(self, generation: GenerationRequest, seq: EngineSequence) -> None:
        assert seq.finished_at is not None and seq.first_token_at is not None
        self.metrics.finished(seq.prompt_len, len(seq.output_ids),
                              seq.finished_at - seq.arrival, generation.finish_reason)

    def _body(self, generation: GenerationRequest, sequences: list[EngineSequence]) -> dict:
        created = int(time.time())
        prompt_tokens = completion_tokens = cached = 0
        texts = []
        for seq in sequences:
            self._record(generation, seq)
            prompt_tokens += seq.prompt_len
            completion_tokens += len(seq.output_ids)
            cached += seq.cached_tokens
            texts.append(self.dummy.text(len(seq.output_ids), generation.allowed_token_ids))
        usage = protocol.usage(prompt_tokens, completion_tokens, cached, generation.kind)
        token_ids = generation.return_token_ids
        if generation.kind == "chat":
            seq = sequences[0]
            return protocol.chat_body(
                self._response_id("chatcmpl"), created, generation.model, texts[0],
                generation.finish_reason, list(seq.output_ids) if token_ids else None,
                list(generation.prompts[0].token_ids) if token_ids else None, usage)
        choices = []
        for index, (seq, prompt, text) in enumerate(zip(sequences, generation.prompts, texts)):
            if generation.echo:
                text = (prompt.text if prompt.text is not None
                        else self.encoder.decode(prompt.token_ids)) + text
            choices.append(protocol.completion_choice(
                index, text, generation.finish_reason,
                list(seq.output_ids) if token_ids else None,
                list(prompt.token_ids) if token_ids else None))
        return protocol.completion_body(self._response_id("cmpl"), created, generation.model,
                                        choices, usage)

    # -- streaming ------------------------------------------------------------------------------
    async def _paced(self, seq: EngineSequence) -> AsyncIterator[int]:
        """Yield output positions 0..n-1 as the engine (approximately) produces them."""
        await seq.first
        yield 0
        total = len(seq.output_ids)
        loop = asyncio.get_running_loop()
        itl = self.driver.itl_estimate(seq)
        started = loop.time()
        for position in range(1, total):
            if seq.done.done():
                seq.done.result()  # aborted at shutdown: raise its error, send no more tokens
            else:
                if position == total - 1 or itl <= 0:
                    await seq.done  # never run ahead of the engine's end
                else:
                    delay = started + position * itl - loop.time()
                    if delay > 0:
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(asyncio.shield(seq.done), delay)
            yield position

    async def _stream(self, generation: GenerationRequest,
                      sequences: list[EngineSequence]) -> AsyncIterator[bytes]:
        kind = generation.kind
        model = generation.model
        created = int(time.time())
        response_id = self._response_id("chatcmpl" if kind == "chat" else "cmpl")
        allowed = generation.allowed_token_ids
        return_ids = generation.return_token_ids
        finished = [False] * len(sequences)
        try:
            if kind == "chat":
                prompt_ids = list(generation.prompts[0].token_ids) if return_ids else None
                try:
                    await sequences[0].first
                except APIError as error:
                    yield sse(error.body())
                    yield SSE_DONE
                    return
                yield sse(protocol.chat_role_chunk(response_id, created, model, prompt_ids))
            queue: asyncio.Queue = asyncio.Queue()
            tasks = [asyncio.ensure_future(self._feed(i, seq, queue))
                     for i, seq in enumerate(sequences)]
            try:
                remaining = len(sequences)
                while remaining:
                    index, position = await queue.get()
                    seq = sequences[index]
                    if isinstance(position, APIError):
                        yield sse(position.body())
                        finished[index] = True
                        remaining -= 1
                        continue
                    if position is None:
                        finished[index] = True
                        remaining -= 1
                        continue
                    yield self._chunk(generation, response_id, created, index, seq, position,
                                      allowed, return_ids)
            finally:
                for task in tasks:
                    task.cancel()
            if generation.include_usage:
                prompt_tokens = sum(s.prompt_len for s in sequences)
                completion_tokens = sum(len(s.output_ids) for s in sequences)
                cached = sum(s.cached_tokens for s in sequences)
                yield sse(protocol.usage_chunk(response_id, created, model, kind,
                                               protocol.usage(prompt_tokens, completion_tokens,
                                                              cached, kind, full=False)))
            yield SSE_DONE
            for seq in sequences:
                if seq.finished_at is not None:
                    self._record(generation, seq)
        finally:
            for seq, done in zip(sequences, finished):
                if not done and not seq.done.done():
                    self.driver.abort(seq)

    async def _feed(self, index: int, seq: EngineSequence, queue: asyncio.Queue) -> None:
        try:
            async for position in self._paced(seq):
                queue.put_nowait((index, position))
        except APIError as error:
            queue.put_nowait((index, error))
            return
        queue.put_nowait((index, None))

    def _chunk(self, generation: GenerationRequest, response_id: str, created: int,
               index: int, seq: EngineSequence, position: int, allowed, return_ids: bool
               ) -> bytes:
        total = len(seq.output_ids)
        last = position == total - 1
        text = self.dummy.piece_texts(position, position + 1, allowed)[0]
        token_ids = [seq.output_ids[position]] if return_ids else None
        finish = generation.finish_reason if last else None
        if generation.kind == "chat":
            chunk = protocol.chat_chunk(response_id, created, generation.model, text, finish,
                                        token_ids)
        else:
            prompt_ids = None
            if return_ids and position == 0:
                prompt_ids = list(generation.prompts[index].token_ids)
            if generation.echo and position == 0:
                prompt = generation.prompts[index]
                text = (prompt.text if prompt.text is not None
                        else self.encoder.decode(prompt.token_ids)) + text
            chunk = protocol.completion_chunk(response_id, created, generation.model, index,
                                              text, finish, token_ids, prompt_ids)
        if generation.continuous_usage:
            chunk["usage"] = protocol.usage(seq.prompt_len, position + 1, None,
                                            generation.kind, full=False)
        if last and not generation.include_usage and len(generation.prompts) == 1:
            chunk["system_fingerprint"] = protocol.SYSTEM_FINGERPRINT
        return sse(chunk)

    # -- render ---------------------------------------------------------------------------------
    def _rendered(self, generation: GenerationRequest, index: int, request_id: str) -> dict:
        """vLLM's ``GenerateRequest`` (``--enable-scale-out`` render endpoints): the token ids
        and the sampling parameters the engine would run. The emulator samples nothing, so
        the sampling fields are vLLM's defaults; chat renders carry the resolved
        ``max_tokens``, completions renders none (as vLLM 0.32 answers)."""
        prompt = generation.prompts[index]
        sampling: dict[str, Any] = {
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
            "temperature": 1.0, "top_p": 1.0, "min_p": 0.0, "stop": [], "stop_token_ids": []}
        if generation.kind == "chat":
            sampling["max_tokens"] = generation.max_tokens[index] \
                if generation.explicit_max_tokens else self.max_model_len - len(prompt.token_ids)
        sampling.update({"output_kind": 2, "skip_clone": True, "bad_words": [],
                         "skip_reading_prefix_cache": False})
        features = None
        if prompt.media:
            # vLLM's MultiModalFeatures: hashes and placeholder ranges per modality, each list
            # in prompt order. ``kwargs_data`` and ``mm_metadata`` carry processed tensors in
            # vLLM (null with ``mm_payload: "none"``); the emulator has none to send.
            hashes: dict[str, list[str]] = {}
            places: dict[str, list[dict]] = {}
            for item, modality in zip(prompt.media, prompt.modalities):
                hashes.setdefault(modality, []).append(item.identifier)
                places.setdefault(modality, []).append({"offset": item.offset,
                                                        "length": item.length})
            features = {"mm_hashes": hashes, "mm_placeholders": places, "kwargs_data": None,
                        "mm_metadata": None}
        return {"request_id": request_id, "token_ids": list(prompt.token_ids),
                "token_offsets": None, "features": features, "content_parts": None,
                "sampling_params": sampling, "model": generation.model,
                "reasoning_ended": None, "reasoning_parser_kwargs": None,
                "return_token_ids": generation.return_token_ids or None,
                "output_mode": "tokens", "stream": generation.stream, "stream_options": None,
                "cache_salt": generation.cache_salt, "priority": generation.priority,
                "kv_transfer_params": None, "ec_transfer_params": None}

    async def render_completions(self, request: Request) -> Response:
        try:
            generation = await self._parse(request, "completion")
        except APIError as error:
            return error_response(error)
        request_id = self._response_id("cmpl")
        return json_response([self._rendered(generation, i, request_id)
                              for i in range(len(generation.prompts))])

    async def render_chat(self, request: Request) -> Response:
        try:
            generation = await self._parse(request, "chat")
        except APIError as error:
            return error_response(error)
        return json_response(self._rendered(generation, 0, self._response_id("chatcmpl")))


def serve(config: EmulatorConfig, *, log_level: str = "warning") -> int:
    """Run the emulator under uvicorn (uvloop, httptools) until SIGINT/SIGTERM; on either,
    abort what the engine holds and exit promptly (see the module docstring)."""
    import uvicorn

    server = EmulatorServer(config)

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            aborted = server.begin_shutdown()
            if aborted:
                log.info("shutdown: aborted %d sequence(s) in flight", aborted)
            await super().shutdown(sockets)

    # host and port only name the address in uvicorn's own log lines: it serves on ``sock``.
    uv_config = uvicorn.Config(server.app(), host=config.host, port=config.port, loop="uvloop",
                               http="httptools", log_level=log_level, access_log=False,
                               lifespan="on", timeout_keep_alive=30,
                               timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    uvicorn_server = _Server(uv_config)
    sock = bind_socket(config.host, config.port)  # a taken port: ConfigError, exit 2
    try:
        server.start_kv_events()  # before serving, so a bad endpoint is a clean ConfigError
        # One line whatever the log level: where it listens and what it serves.
        print(f"prefixroute replica: model {config.served_model_name!r} on "
              f"{listen_url(sock)}: {server.num_blocks} blocks of "
              f"{config.block_size} tokens ({server.capacity_source}), time model "
              f"{server.service.name}, tokenizer {server.encoder.description}",
              file=sys.stderr, flush=True)
        uvicorn_server.run(sockets=[sock])
    finally:
        sock.close()
        server.close()
    return 0 if uvicorn_server.started else 1
