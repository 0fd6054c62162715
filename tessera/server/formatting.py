"""Engine outputs -> OpenAI response pieces: usage, both logprobs formats, SSE framing."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from tessera.engine.async_engine import EngineDeadError
from tessera.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from tessera.sampling import SamplingParams
from tessera.server.errors import APIError
from tessera.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    ErrorInfo,
    ErrorResponse,
    TopLogprob,
    UsageInfo,
)

logger = logging.getLogger("tessera.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = "data: [DONE]\n\n"


def has_news(c: CompletionOutput, params: SamplingParams) -> bool:
    """Whether this choice's delta is worth a chunk."""
    # Tokens whose text is still held back (an incomplete character, a possible stop string) wait
    # for the next chunk unless their logprobs must go out now.
    return bool(c.delta_text) or c.finish_reason is not None or (
        params.logprobs is not None and bool(c.delta_token_ids))


def usage_of(outputs: list[RequestOutput]) -> UsageInfo:
    """Prompt tokens once per prompt (not per choice), completion tokens over all choices, as OpenAI counts."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def completion_logprobs(token_ids: list[int], entries: list[TokenLogprobs | None], num_top: int,
                         start_offset: int) -> CompletionLogprobs:
    """The legacy format: parallel lists; top_logprobs holds the top `num_top` plus the sampled token."""
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


def chat_logprobs(token_ids: list[int], entries: list[TokenLogprobs | None], num_top: int) -> ChatLogprobs:
    """The chat format: one record per token with its own top-`num_top` list.

    `bytes` are the UTF-8 of the decoded token text, so a token that is only part of a character
    shows U+FFFD's bytes rather than its raw bytes.
    """
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


def json_response(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


class SSEResponse(StreamingResponse):
    """A text/event-stream response that runs `on_close` however the response ends.

    Starlette cancels the body when the client disconnects, which normally aborts the requests
    from inside the body generator; but a disconnect before the generator first runs would skip
    that, so `on_close` (aborting what is unfinished) runs here as well.
    """

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse_response(body: AsyncIterator[str], on_close: Callable[[], None]) -> SSEResponse:
    return SSEResponse(body, on_close)


def sse_data(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def sse_error(exc: Exception) -> str:
    """An error after the stream started, sent in-band (the `openai` client raises it), as vLLM does."""
    if isinstance(exc, APIError):
        info = ErrorInfo(message=exc.message, type=exc.type, param=exc.param, code=exc.code)
    else:
        # A shutdown ends streams with a plain EngineDeadError (503); a crash chains its cause (500).
        status = 503 if isinstance(exc, EngineDeadError) and exc.__cause__ is None else 500
        logger.warning("stream ended by %r", exc)
        info = ErrorInfo(message=str(exc) or repr(exc),
                         type="service_unavailable" if status == 503 else "internal_server_error")
    return f"data: {ErrorResponse(error=info).model_dump_json()}\n\n"
