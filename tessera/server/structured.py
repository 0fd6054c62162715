"""Structured outputs and tool calls on the chat route: request -> constraint, output -> message.

ChatStructure resolves one chat body (response_format, vLLM's structured_outputs, tools and
tool_choice) into at most one constraint and a tool plan, raising APIError 400 naming the field
that is wrong. After generation it turns each choice's text into the assistant message, with
tool_calls and finish_reason "tool_calls" when the model called tools; ChoiceStream does the
same delta by delta for a stream. The parsing itself lives in tessera/structured.
"""

from __future__ import annotations

import asyncio
import uuid

from tessera.server.errors import APIError
from tessera.server.protocol import (
    ChatCompletionRequest,
    ChatMessageOut,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from tessera.structured.params import StructuredOutputsParams
from tessera.structured.tool_parsers import ParsedToolCall, StreamingToolCalls, ToolParser
from tessera.structured.tools import (
    ToolPlan,
    constrained_tool_calls,
    extra_constraint,
    plan_tools,
    response_format_constraint,
    tool_constraint,
    with_options,
)


def _bad(param: str, exc: ValueError) -> APIError:
    return APIError(400, str(exc), param=param, code="invalid_value")


def parse_extra_constraint(body) -> StructuredOutputsParams | None:
    try:
        return extra_constraint(body.structured_outputs)
    except ValueError as exc:
        raise _bad("structured_outputs", exc) from None


async def check_compiles(engine, constraint: StructuredOutputsParams | None, param: str | None) -> None:
    """A 400 now if the constraint does not compile (the compile runs on the grammar thread and
    is cached, so the engine finds it ready)."""
    manager = getattr(getattr(engine, "engine", None), "structured", None)
    if constraint is None or manager is None:
        return
    try:
        await asyncio.wrap_future(manager.compile(constraint))
    except ValueError as exc:
        raise _bad(param or "structured_outputs", exc) from None


def _finish(finish_reason: str | None, calls: list) -> str | None:
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def _tool_call(call: ParsedToolCall) -> ToolCall:
    return ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def _delta_call(index: int, call: ParsedToolCall) -> DeltaToolCall:
    return DeltaToolCall(index=index, id=call.id, type="function",
                         function=DeltaFunctionCall(name=call.name, arguments=call.arguments))


class ChatStructure:
    def __init__(self, body: ChatCompletionRequest, parser: ToolParser) -> None:
        self.parser = parser
        try:
            self.plan: ToolPlan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        except ValueError as exc:
            raise _bad("tools" if "tools" in str(exc).split(" ", 1)[0] else "tool_choice", exc) from None
        found = []
        for param, build in (("response_format", lambda: response_format_constraint(body.response_format)),
                             ("structured_outputs", lambda: extra_constraint(body.structured_outputs)),
                             ("tool_choice", lambda: tool_constraint(self.plan))):
            try:
                constraint = build()
            except ValueError as exc:
                raise _bad(param, exc) from None
            if constraint is not None:
                found.append((param, constraint))
        if len(found) > 1:
            raise APIError(400, f"{' and '.join(p for p, _ in found)} each constrain the output; give only one",
                           param=found[1][0])
        self.param, self.constraint = found[0] if found else (None, None)
        try:
            self.constraint = with_options(self.constraint, body.structured_outputs)
        except (TypeError, ValueError) as exc:
            raise _bad("structured_outputs", exc) from None

    @property
    def uses_tools(self) -> bool:
        return self.plan.active

    def message(self, text: str, finish_reason: str | None) -> tuple[ChatMessageOut, str | None]:
        """The assistant message of one finished choice, and its finish_reason."""
        if not self.plan.active:
            return ChatMessageOut(content=text), finish_reason
        if self.plan.mode == "auto":
            content, calls = self.parser.parse(text)
        else:
            content, calls = None, constrained_tool_calls(self.plan, text)
            if not calls:
                content = text  # cut short (finish_reason "length"): show what there is
        return ChatMessageOut(content=content, tool_calls=[_tool_call(c) for c in calls]), _finish(finish_reason, calls)

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """One streamed choice: text deltas in, DeltaMessages out (content and/or tool_calls)."""

    def __init__(self, structure: ChatStructure) -> None:
        self.plan = structure.plan
        self.mode = structure.plan.mode if structure.plan.active else "none"
        self._auto = StreamingToolCalls(structure.parser) if self.mode == "auto" else None
        self._text = ""
        self._named_id = f"call_{uuid.uuid4().hex[:24]}"
        self._named_started = False

    def step(self, delta_text: str, finish_reason: str | None) -> tuple[DeltaMessage | None, str | None]:
        self._text += delta_text
        if self.mode == "none":
            return (DeltaMessage(content=delta_text) if delta_text else None), finish_reason
        if self.mode == "auto":
            content = self._auto.feed(delta_text)
            calls: list[ParsedToolCall] = []
            if finish_reason is not None:
                rest, calls = self._auto.finish()
                content += rest
            deltas = [_delta_call(i, c) for i, c in enumerate(calls)] or None
            if not content and deltas is None:
                return None, _finish(finish_reason, calls)
            return DeltaMessage(content=content or None, tool_calls=deltas), _finish(finish_reason, calls)
        if self.mode == "named":
            # The whole output is the arguments: stream them as they come.
            calls = []
            if not self._named_started and (delta_text or finish_reason is not None):
                self._named_started = True
                call = DeltaToolCall(index=0, id=self._named_id, type="function",
                                     function=DeltaFunctionCall(name=self.plan.function, arguments=delta_text))
            elif delta_text:
                call = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta_text))
            else:
                call = None
            if finish_reason is not None:
                calls = constrained_tool_calls(self.plan, self._text)
            return (DeltaMessage(tool_calls=[call]) if call else None), _finish(finish_reason, calls)
        # required: a JSON array of calls, parsed when complete
        if finish_reason is None:
            return None, None
        calls = constrained_tool_calls(self.plan, self._text)
        if not calls:
            return DeltaMessage(content=self._text or None), finish_reason
        return DeltaMessage(tool_calls=[_delta_call(i, c) for i, c in enumerate(calls)]), _finish(finish_reason, calls)
