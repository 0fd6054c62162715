"""OpenAI-style error bodies for every failure the server reports.

Every error, ours or the framework's, leaves as `{"error": {"message", "type", "param", "code"}}`
with the HTTP status OpenAI would use. FastAPI's request validation errors (its 422) are turned
into a 400 `invalid_request_error` naming the offending field, as OpenAI and vLLM answer them.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tessera.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("tessera.server")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}

# Request fields a SamplingParams error message may start with ("top_p must be in (0, 1]...").
_FIELDS = (
    "n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
    "include_stop_str_in_output", "logprobs", "skip_special_tokens",
)


class APIError(Exception):
    """An error to send to the client as is."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers  # e.g. Retry-After on a 503
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status_code, "invalid_request_error")


def invalid_param(exc: ValueError, default_param: str | None = None) -> APIError:
    """A 400 for a ValueError from SamplingParams or the engine, naming the field when it can."""
    message = str(exc)
    first = message.split(" ", 1)[0]
    param = first if first in _FIELDS else default_param
    return APIError(400, message, param=param, code="invalid_value")


def _is_type_tag(part) -> bool:
    """Whether a pydantic error location part names a union member's type, not a field."""
    if not isinstance(part, str):
        return False  # a list index
    return part in ("str", "int", "float", "bool", "bytes", "none") or not part.replace("_", "a").isalnum() \
        or not part[:1].islower()


def error_response(exc: APIError) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=exc.message, type=exc.type, param=exc.param, code=exc.code))
    headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else {}
    headers.update(exc.headers or {})
    return JSONResponse(body.model_dump(), status_code=exc.status_code, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # One entry per field: a union field (prompt: str | list[str] | ...) fails once per member,
        # under locations tagged with the member's type, which are no field names.
        by_field: dict[str, list[str]] = {}
        for err in exc.errors():
            loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _is_type_tag(x)]
            msgs = by_field.setdefault(".".join(loc), [])
            if err.get("msg", "invalid") not in msgs:
                msgs.append(err.get("msg", "invalid"))
        fields = list(by_field.items())
        parts = [f"{where or 'body'}: {' | '.join(msgs)}" for where, msgs in fields[:3]]
        more = f" (and {len(fields) - 3} more)" if len(fields) > 3 else ""
        param = next((where for where, _ in fields if where), None)
        return error_response(APIError(400, "invalid request: " + "; ".join(parts) + more, param=param,
                                       code="invalid_request"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal server error: {exc!r}"))
