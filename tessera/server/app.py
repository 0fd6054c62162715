"""The OpenAI-compatible HTTP routes: completions, chat, models, tokenize, health and metrics.

A route validates the body (pydantic, then SamplingParams), tokenizes the prompt, checks it
against the context length, and hands one engine request per prompt to the AsyncLLMEngine. It
answers either one JSON body or an SSE stream of `data: {...}` chunks ending in `data: [DONE]`.
A client that goes away (mid-stream, or while waiting for a non-streamed answer) has its
requests aborted at once, which frees their KV blocks.

Authentication (`--api-key` / TESSERA_API_KEY) covers /v1/* and the tokenize endpoints;
/health and /metrics stay open for probes and scrapers, as in vLLM.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from tessera.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from tessera.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from tessera.sampling import SamplingParams
from tessera.server.errors import APIError, error_response, install_error_handlers, invalid_param
from tessera.server.metrics import ServerMetrics
from tessera.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatMessageOut,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    UsageInfo,
)

logger = logging.getLogger("tessera.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientDisconnected(Exception):
    pass


def create_app(config, served_model_name: str | None = None, api_key: str | None = None) -> FastAPI:
    """Load the engine for `config` (an EngineConfig) and build the app around it."""
    name = served_model_name or config.model
    metrics = ServerMetrics(name)
    engine = AsyncLLMEngine.from_config(config, observer=metrics)
    return build_app(engine, metrics, served_model_name=name, api_key=api_key, model_root=config.model)


def build_app(engine: AsyncLLMEngine, metrics: ServerMetrics, *, served_model_name: str,
              api_key: str | None = None, model_root: str | None = None, owns_engine: bool = True) -> FastAPI:
    """The FastAPI app over a running AsyncLLMEngine; shuts the engine down with the app if it owns it."""
    metrics.bind_stats(engine.stats)
    server = OpenAIServer(engine, served_model_name, model_root)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if owns_engine:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="Tessera", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.served_model_name = served_model_name
    install_error_handlers(app)

    @app.exception_handler(ClientDisconnected)
    async def _client_gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; keeps the log free of tracebacks

    protected = APIRouter(dependencies=[Depends(_auth_dependency(api_key))] if api_key else [])
    protected.add_api_route("/v1/models", server.list_models, methods=["GET"])
    protected.add_api_route("/v1/completions", server.create_completion, methods=["POST"])
    protected.add_api_route("/v1/chat/completions", server.create_chat_completion, methods=["POST"])
    protected.add_api_route("/tokenize", server.tokenize, methods=["POST"])
    protected.add_api_route("/detokenize", server.detokenize, methods=["POST"])
    app.include_router(protected)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_healthy:
            return Response(status_code=200)
        reason = f"the engine failed: {engine.error!r}" if engine.error else "the engine is shutting down"
        return error_response(APIError(503, reason))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _auth_dependency(api_key: str):
    expected = api_key.encode()

    async def check_api_key(request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>' with the key "
                                "the server was started with (--api-key / TESSERA_API_KEY)",
                           code="invalid_api_key")

    return check_api_key


class OpenAIServer:
    """The route handlers; one instance per app."""

    def __init__(self, engine: AsyncLLMEngine, served_model_name: str, model_root: str | None) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.model_root = model_root
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len

    # ---- simple routes ------------------------------------------------------------------------

    async def list_models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, root=self.model_root, max_model_len=self.max_model_len)])

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
        if body.messages is not None:
            text = self._render_chat(body.messages, body.add_generation_prompt)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        strs = [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids] if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(body.model)
        self._check_token_ids(body.tokens, "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(body.tokens, skip_special_tokens=False))

    # ---- completions --------------------------------------------------------------------------

    async def create_completion(self, body: CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        self._check_model(body.model)
        self._reject_unsupported(body)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        params = self._sampling_params(body, body.max_tokens, body.logprobs)
        prompts = self._completion_prompts(body.prompt)
        for ids in prompts:
            self._check_length(ids, params.max_tokens, "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self._add_requests(request_id, prompts, params, arrival)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(self._stream_completion(request_id, streams, params, include_usage))
        finals = await self._collect(raw, streams)
        choices = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                logprobs = None
                if params.logprobs is not None:
                    logprobs = _completion_logprobs(c.token_ids, c.logprobs or [], params.logprobs, 0)
                choices.append(CompletionChoice(index=i * params.n + c.index, text=c.text, logprobs=logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return _json(CompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=_usage(finals)))

    async def _stream_completion(self, request_id: str, streams: list[RequestStream], params: SamplingParams,
                                 include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())
        finished: set[int] = set()
        offsets: dict[int, int] = {}
        last: dict[int, RequestOutput] = {}
        try:
            async for i, out in self._merged(streams):
                last[i] = out
                for c in out.outputs:
                    index = i * params.n + c.index
                    if index in finished or not _has_news(c, params):
                        continue
                    logprobs = None
                    if params.logprobs is not None:
                        logprobs = _completion_logprobs(c.delta_token_ids, c.delta_logprobs or [], params.logprobs,
                                                        offsets.get(index, 0))
                        offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1]) if logprobs.tokens \
                            else offsets.get(index, 0)
                    if c.finish_reason is not None:
                        finished.add(index)
                    chunk = CompletionResponse(
                        id=request_id, created=created, model=self.model_name,
                        choices=[CompletionChoice(index=index, text=c.delta_text, logprobs=logprobs,
                                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason)],
                    )
                    yield _sse_data(chunk)
            if include_usage:
                usage_chunk = CompletionResponse(id=request_id, created=created, model=self.model_name, choices=[],
                                                 usage=_usage([last[i] for i in sorted(last)]))
                yield _sse_data(usage_chunk)
        except Exception as exc:  # the stream has started: report in-band, as vLLM does
            yield _sse_error(exc)
        yield "data: [DONE]\n\n"

    # ---- chat ---------------------------------------------------------------------------------

    async def create_chat_completion(self, body: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        self._check_model(body.model)
        self._reject_unsupported(body)
        for name in ("tools", "response_format"):
            if getattr(body, name):
                raise APIError(400, f"{name} is not supported", param=name)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = self._sampling_params(body, max_tokens, logprobs)
        ids = self.tokenizer.encode(self._render_chat(body.messages, body.add_generation_prompt),
                                    add_special_tokens=False)
        self._check_length(ids, params.max_tokens, "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self._add_requests(request_id, [ids], params, arrival)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(self._stream_chat(request_id, streams, params, include_usage))
        (final,) = await self._collect(raw, streams)
        choices = [
            ChatChoice(
                index=c.index,
                message=ChatMessageOut(content=c.text),
                logprobs=_chat_logprobs(c.token_ids, c.logprobs or [], params.logprobs)
                if params.logprobs is not None else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in final.outputs
        ]
        return _json(ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                            usage=_usage([final])))

    async def _stream_chat(self, request_id: str, streams: list[RequestStream], params: SamplingParams,
                           include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(index: int, delta: DeltaMessage, logprobs=None, finish_reason=None, stop_reason=None) -> str:
            return _sse_data(ChatCompletionChunk(
                id=request_id, created=created, model=self.model_name,
                choices=[ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                                         stop_reason=stop_reason)],
            ))

        finished: set[int] = set()
        final: RequestOutput | None = None
        try:
            # The role first, for every choice, before any token: it also flushes the headers.
            for index in range(params.n):
                yield chunk(index, DeltaMessage(role="assistant", content=""))
            async for _, out in self._merged(streams):
                final = out
                for c in out.outputs:
                    if c.index in finished or not _has_news(c, params):
                        continue
                    logprobs = None
                    if params.logprobs is not None:
                        logprobs = _chat_logprobs(c.delta_token_ids, c.delta_logprobs or [], params.logprobs)
                    if c.finish_reason is not None:
                        finished.add(c.index)
                    yield chunk(c.index, DeltaMessage(content=c.delta_text or None), logprobs, c.finish_reason,
                                c.stop_reason)
            if include_usage and final is not None:
                yield _sse_data(ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=[],
                                                    usage=_usage([final])))
        except Exception as exc:
            yield _sse_error(exc)
        yield "data: [DONE]\n\n"

    # ---- shared plumbing ----------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r} "
                                f"(set with --served-model-name)", param="model", code="model_not_found")

    @staticmethod
    def _reject_unsupported(body) -> None:
        if body.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of other than n is not supported", param="best_of")

    @staticmethod
    def _sampling_params(body, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens, logprobs)
        except ValueError as exc:
            raise invalid_param(exc) from None

    def _completion_prompts(self, prompt: str | list) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.tokenizer.encode(prompt)]
        if not prompt:
            raise APIError(400, "prompt is empty: give a string, a list of strings or a list of token ids",
                           param="prompt")
        if isinstance(prompt[0], str):
            return [self.tokenizer.encode(p) for p in prompt]
        if isinstance(prompt[0], int):
            prompts = [list(prompt)]
        else:
            prompts = [list(p) for p in prompt]
        for ids in prompts:
            self._check_token_ids(ids, "prompt")
        return prompts

    def _check_token_ids(self, ids: Sequence[int], param: str) -> None:
        vocab = self.engine.engine.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of the vocabulary (0..{vocab - 1})", param=param,
                           code="invalid_value")

    def _check_length(self, ids: list[int], max_tokens: int | None, param: str) -> None:
        limit = self.max_model_len
        if not ids:
            raise APIError(400, "the prompt is empty: give at least one token", param=param)
        if len(ids) >= limit:
            raise APIError(
                400, f"the prompt has {len(ids)} tokens but the model's context is {limit} tokens (prompt plus at "
                     f"least one output token); shorten the prompt or raise --max-model-len",
                param=param, code="context_length_exceeded")
        if max_tokens is not None and len(ids) + max_tokens > limit:
            raise APIError(
                400, f"the prompt has {len(ids)} tokens and max_tokens is {max_tokens}: {len(ids) + max_tokens} "
                     f"tokens, more than the model's context of {limit} tokens; lower max_tokens, shorten the "
                     f"prompt, or raise --max-model-len",
                param="max_tokens", code="context_length_exceeded")

    def _render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool) -> str:
        conversation = []
        for i, m in enumerate(messages):
            if m.content is None or isinstance(m.content, str):
                content = m.content or ""
            else:
                texts = []
                for part in m.content:
                    if isinstance(part, BaseModel):
                        texts.append(part.text)
                    else:
                        raise APIError(400, f"messages[{i}].content: only text parts are supported, got type "
                                            f"{part.get('type')!r}", param=f"messages.{i}.content")
                content = "\n".join(texts)
            role = "system" if m.role == "developer" else m.role
            conversation.append({"role": role, "content": content})
        try:
            return self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None

    async def _add_requests(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                            arrival: float) -> list[RequestStream]:
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        # All at once, so the engine thread picks them up together before its next step.
        results = await asyncio.gather(
            *(self.engine.add_request(rid, p, params, arrival) for rid, p in zip(ids, prompts, strict=True)),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            return list(results)
        self.engine.abort(ids)
        exc = errors[0]
        if isinstance(exc, ValueError):
            raise invalid_param(exc, "prompt")
        if isinstance(exc, EngineDeadError):
            raise APIError(503, str(exc))
        raise exc

    async def _merged(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from several streams as they arrive; leaving early aborts them all."""
        if len(streams) == 1:
            try:
                async for out in self.engine.iterate(streams[0]):
                    yield 0, out
            finally:
                if not streams[0].finished:
                    self.engine.abort(streams[0].request_id)
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in self.engine.iterate(stream):
                    queue.put_nowait((i, out))
            except Exception as exc:
                queue.put_nowait((i, exc))
            queue.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            self.engine.abort([s.request_id for s in streams if not s.finished])

    async def _collect(self, raw: Request, streams: list[RequestStream]) -> list[RequestOutput]:
        """The final output of each stream, aborting them all if the client disconnects first."""

        async def run() -> list[RequestOutput]:
            finals: list[Any] = [None] * len(streams)
            async for i, out in self._merged(streams):
                finals[i] = out
            return finals

        work = asyncio.ensure_future(run())
        watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                try:
                    return work.result()
                except EngineDeadError as exc:
                    raise APIError(503, str(exc)) from None
            logger.info("client disconnected; aborted %s", ", ".join(s.request_id for s in streams))
            raise ClientDisconnected()
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()
            self.engine.abort([s.request_id for s in streams if not s.finished])


async def _wait_for_disconnect(raw: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (uvicorn sends it when
    # the peer closes, or once the response is complete).
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


def _has_news(c: CompletionOutput, params: SamplingParams) -> bool:
    # Tokens whose text is still held back (an incomplete character, a possible stop string) wait
    # for the next chunk unless their logprobs must go out now.
    return bool(c.delta_text) or c.finish_reason is not None or (
        params.logprobs is not None and bool(c.delta_token_ids))


def _usage(outputs: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _completion_logprobs(token_ids: list[int], entries: list[TokenLogprobs | None], num_top: int,
                         start_offset: int) -> CompletionLogprobs:
    lp = CompletionLogprobs()
    offset = start_offset
    for tid, entry in zip(token_ids, entries, strict=False):
        sampled = entry.get(tid) if entry else None
        token = sampled.decoded_token if sampled is not None and sampled.decoded_token is not None else ""
        lp.tokens.append(token)
        lp.token_logprobs.append(sampled.logprob if sampled is not None else None)
        lp.text_offset.append(offset)
        offset += len(token)
        if entry is None:
            lp.top_logprobs.append(None)
        else:
            top = sorted(entry.items(), key=lambda kv: kv[1].rank)
            lp.top_logprobs.append({(x.decoded_token or ""): x.logprob for t, x in top
                                    if x.rank <= num_top or t == tid})
    return lp


def _chat_logprobs(token_ids: list[int], entries: list[TokenLogprobs | None], num_top: int) -> ChatLogprobs:
    content = []
    for tid, entry in zip(token_ids, entries, strict=False):
        if not entry or tid not in entry:
            continue
        sampled = entry[tid]
        token = sampled.decoded_token or ""
        top = [TopLogprob(token=x.decoded_token or "", logprob=x.logprob, bytes=list((x.decoded_token or "").encode()))
               for _, x in sorted(entry.items(), key=lambda kv: kv[1].rank) if x.rank <= num_top][:num_top]
        content.append(ChatTokenLogprob(token=token, logprob=sampled.logprob, bytes=list(token.encode()),
                                        top_logprobs=top))
    return ChatLogprobs(content=content)


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _sse(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)


def _sse_data(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def _sse_error(exc: Exception) -> str:
    if isinstance(exc, APIError):
        info = ErrorInfo(message=exc.message, type=exc.type, param=exc.param, code=exc.code)
    else:
        status = 503 if isinstance(exc, EngineDeadError) else 500
        logger.warning("stream ended by %r", exc)
        info = ErrorInfo(message=str(exc) or repr(exc),
                         type="service_unavailable" if status == 503 else "internal_server_error")
    return f"data: {ErrorResponse(error=info).model_dump_json()}\n\n"

