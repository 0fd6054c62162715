"""The OpenAI route handlers: completions, chat completions, models, tokenize and detokenize.

A handler validates the body (pydantic, then SamplingParams), tokenizes the prompt, checks it
against the context length, and hands one engine request per prompt to the AsyncLLMEngine.
Everything that can be refused is refused before the first byte of a stream, so a bad streaming
request gets a normal HTTP error; failures after that are sent in-band as an SSE `error` chunk.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from tessera.engine.async_engine import AsyncLLMEngine
from tessera.outputs import RequestOutput
from tessera.sampling import SamplingParams
from tessera.server.admission import AdmissionController, ServerLimits, check_request_limits
from tessera.server.errors import APIError, invalid_param
from tessera.server.formatting import (
    SSE_DONE,
    chat_logprobs,
    completion_logprobs,
    has_news,
    json_response,
    sse_data,
    sse_error,
    sse_response,
    usage_of,
)
from tessera.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from tessera.server.request_group import RequestGroup
from tessera.server.shutdown import Drain
from tessera.server.structured import ChatStructure, check_compiles, parse_extra_constraint
from tessera.structured.tool_parsers import get_tool_parser
from tessera.structured.tools import ToolPlan, render_chat


class OpenAIServer:
    """The route handlers; one instance per app."""

    def __init__(self, engine: AsyncLLMEngine, served_model_name: str, model_root: str | None,
                 limits: ServerLimits | None = None, admission: AdmissionController | None = None,
                 tool_call_parser: str = "hermes") -> None:
        self.engine = engine
        self.tool_parser = get_tool_parser(tool_call_parser)
        self.model_name = served_model_name
        self.model_root = model_root
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.limits = limits or ServerLimits()
        self.admission = admission or AdmissionController(self.limits, engine.max_num_seqs)
        self.drain = Drain()  # the live request groups, for a graceful shutdown (shutdown.py)

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
        constraint = parse_extra_constraint(body)
        params = self._sampling_params(body, body.max_tokens, body.logprobs, constraint)
        await check_compiles(self.engine, constraint, "structured_outputs")
        several = isinstance(body.prompt, list) and bool(body.prompt) and not isinstance(body.prompt[0], int)
        self._check_limits(body, params, len(body.prompt) if several else 1)
        prompts = self._completion_prompts(body.prompt)
        for ids in prompts:
            self._check_length(ids, params.max_tokens, "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        group = await RequestGroup.add(self.engine, request_id, prompts, params, arrival,
                                       ticket=self.admission.admit(params.n, [len(p) for p in prompts]),
                                       timeout=self.limits.timeout_for(body.timeout), live=self.drain.groups)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            body_iter = self._stream_completion(request_id, group, params, include_usage)
            return sse_response(body_iter, on_close=group.abort_unfinished)
        finals = await group.final_outputs(raw)
        choices = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                logprobs = None
                if params.logprobs is not None:
                    logprobs = completion_logprobs(c.token_ids, c.logprobs or [], params.logprobs, 0)
                choices.append(CompletionChoice(index=i * params.n + c.index, text=c.text, logprobs=logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return json_response(CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                                usage=usage_of(finals)))

    async def _stream_completion(self, request_id: str, group: RequestGroup, params: SamplingParams,
                                 include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())
        finished: set[int] = set()
        offsets: dict[int, int] = {}
        last: dict[int, RequestOutput] = {}
        try:
            async for i, out in group.outputs():
                last[i] = out
                for c in out.outputs:
                    index = i * params.n + c.index
                    if index in finished or not has_news(c, params):
                        continue
                    logprobs = None
                    if params.logprobs is not None:
                        logprobs = completion_logprobs(c.delta_token_ids, c.delta_logprobs or [], params.logprobs,
                                                        offsets.get(index, 0))
                        offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs.tokens)
                    if c.finish_reason is not None:
                        finished.add(index)
                    chunk = CompletionResponse(
                        id=request_id, created=created, model=self.model_name,
                        choices=[CompletionChoice(index=index, text=c.delta_text, logprobs=logprobs,
                                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason)],
                    )
                    yield sse_data(chunk)
            if include_usage:
                usage_chunk = CompletionResponse(id=request_id, created=created, model=self.model_name, choices=[],
                                                 usage=usage_of([last[i] for i in sorted(last)]))
                yield sse_data(usage_chunk)
        except Exception as exc:  # the stream has started: report in-band, as vLLM does
            yield sse_error(exc)
        yield SSE_DONE

    # ---- chat ---------------------------------------------------------------------------------

    async def create_chat_completion(self, body: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        self._check_model(body.model)
        self._reject_unsupported(body)
        structure = ChatStructure(body, self.tool_parser)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = self._sampling_params(body, max_tokens, logprobs, structure.constraint)
        self._check_limits(body, params, 1)
        await check_compiles(self.engine, structure.constraint, structure.param)
        ids = self.tokenizer.encode(self._render_chat(body.messages, body.add_generation_prompt, structure.plan),
                                    add_special_tokens=False)
        self._check_length(ids, params.max_tokens, "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        group = await RequestGroup.add(self.engine, request_id, [ids], params, arrival,
                                       ticket=self.admission.admit(params.n, [len(ids)]),
                                       timeout=self.limits.timeout_for(body.timeout), live=self.drain.groups)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            body_iter = self._stream_chat(request_id, group, params, include_usage, structure)
            return sse_response(body_iter, on_close=group.abort_unfinished)
        (final,) = await group.final_outputs(raw)
        choices = []
        for c in final.outputs:
            message, finish_reason = structure.message(c.text, c.finish_reason)
            choices.append(ChatChoice(
                index=c.index,
                message=message,
                logprobs=chat_logprobs(c.token_ids, c.logprobs or [], params.logprobs)
                if params.logprobs is not None else None,
                finish_reason=finish_reason,
                stop_reason=c.stop_reason,
            ))
        return json_response(ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                            usage=usage_of([final])))

    async def _stream_chat(self, request_id: str, group: RequestGroup, params: SamplingParams,
                           include_usage: bool, structure: ChatStructure) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(index: int, delta: DeltaMessage, logprobs=None, finish_reason=None, stop_reason=None) -> str:
            return sse_data(ChatCompletionChunk(
                id=request_id, created=created, model=self.model_name,
                choices=[ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                                         stop_reason=stop_reason)],
            ))

        finished: set[int] = set()
        final: RequestOutput | None = None
        streams = [structure.stream() for _ in range(params.n)]  # tool calls are parsed per choice
        try:
            # The role first, for every choice, before any token: it also flushes the headers.
            for index in range(params.n):
                yield chunk(index, DeltaMessage(role="assistant", content=""))
            async for _, out in group.outputs():
                final = out
                for c in out.outputs:
                    if c.index in finished or not has_news(c, params):
                        continue
                    logprobs = None
                    if params.logprobs is not None:
                        logprobs = chat_logprobs(c.delta_token_ids, c.delta_logprobs or [], params.logprobs)
                    if c.finish_reason is not None:
                        finished.add(c.index)
                    delta, finish_reason = streams[c.index].step(c.delta_text, c.finish_reason)
                    if delta is None and finish_reason is None and logprobs is None:
                        continue  # text held back (a tool call being assembled)
                    yield chunk(c.index, delta or DeltaMessage(), logprobs, finish_reason, c.stop_reason)
            if include_usage and final is not None:
                yield sse_data(ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=[],
                                                    usage=usage_of([final])))
        except Exception as exc:
            yield sse_error(exc)
        yield SSE_DONE

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

    def _check_limits(self, body, params: SamplingParams, num_prompts: int) -> None:
        if self.drain.draining:
            raise APIError(503, "the server is shutting down and takes no new requests; retry on another "
                                "replica or after the restart", code="server_shutting_down",
                           headers={"Retry-After": str(self.limits.retry_after_s)})
        check_request_limits(self.limits, n=params.n, num_prompts=num_prompts, stop=params.stop,
                             stop_token_ids=params.stop_token_ids, vocab_size=self.engine.model_config.vocab_size,
                             timeout=body.timeout)

    @staticmethod
    def _sampling_params(body, max_tokens: int | None, logprobs: int | None, constraint=None) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens, logprobs, constraint)
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
        vocab = self.engine.model_config.vocab_size
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

    def _render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool, plan: ToolPlan | None = None) -> str:
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
            entry = {"role": role, "content": content}
            if m.tool_calls:
                entry["tool_calls"] = m.tool_calls
            if m.tool_call_id is not None:
                entry["tool_call_id"] = m.tool_call_id
            conversation.append(entry)
        try:
            if (plan is not None and plan.active) or any(m.role == "tool" or m.tool_calls for m in messages):
                return render_chat(self.tokenizer.hf, conversation, plan or ToolPlan([], "none"), self.tool_parser,
                                   add_generation_prompt)
            return self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
