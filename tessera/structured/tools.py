"""OpenAI `tools` / `tool_choice` / `response_format` -> constraints, prompts and tool calls.

tool_choice "none" ignores the tools; "auto" lets the model answer or call, and the
--tool-call-parser reads its calls out of the text; "required" and a named function are
enforced, not hoped for (as vLLM does): the output is constrained by a JSON schema, for
"required" a non-empty array of {"name": <a tool's name>, "parameters": <its arguments>}
(one element when parallel_tool_calls is false), for a named function that function's
arguments object. Everything here raises ValueError with a message for a 400. Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from tessera.structured.params import CONSTRAINT_KINDS, StructuredOutputsParams
from tessera.structured.tool_parsers import ParsedToolCall, ToolParser

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass
class ToolPlan:
    """How one chat request uses its tools."""

    tools: list[dict]  # validated {"type": "function", "function": {...}} entries
    mode: str  # "none" | "auto" | "required" | "named"
    function: str | None = None  # the named function
    parallel: bool = True

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.mode != "none"


def validate_tools(tools: list[Any] | None) -> list[dict]:
    if not tools:
        return []
    out, names = [], set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}]: only {{'type': 'function', 'function': {{...}}}} tools are supported")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function needs a non-empty 'name'")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        if fn["name"] in names:
            raise ValueError(f"tools[{i}]: the function name {fn['name']!r} is given twice")
        names.add(fn["name"])
        out.append({"type": "function", "function": fn})
    return out


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolPlan:
    valid = validate_tools(tools)
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    if tool_choice is None:
        return ToolPlan(valid, "auto" if valid else "none", parallel=parallel)
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not valid:
            raise ValueError(f"tool_choice {tool_choice!r} needs a non-empty 'tools' list")
        return ToolPlan(valid, tool_choice, parallel=parallel)
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}")
    known = [t["function"]["name"] for t in valid]
    if name not in known:
        raise ValueError(f"tool_choice names the function {name!r}, which is not in tools "
                         f"({', '.join(map(repr, known)) or 'none given'})")
    return ToolPlan(valid, "named", function=name, parallel=parallel)


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or _ANY_OBJECT


def tool_constraint(plan: ToolPlan) -> StructuredOutputsParams | None:
    """The JSON-schema constraint of a "required" or named tool_choice; None otherwise."""
    if plan.mode == "named":
        tool = next(t for t in plan.tools if t["function"]["name"] == plan.function)
        return StructuredOutputsParams(json=_parameters(tool))
    if plan.mode != "required":
        return None
    item = {"anyOf": [{"type": "object",
                       "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                      "parameters": _parameters(t)},
                       "required": ["name", "parameters"]} for t in plan.tools]}
    schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not plan.parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def constrained_tool_calls(plan: ToolPlan, text: str) -> list[ParsedToolCall]:
    """The calls in the output of a "required" or named request (JSON by construction; a
    truncated output, finish_reason "length", may not parse and then yields no call)."""
    if plan.mode == "named":
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return []
        return [ParsedToolCall(plan.function, text)]
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []
    return [ParsedToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in items]


def response_format_constraint(response_format: dict | None) -> StructuredOutputsParams | None:
    """OpenAI's response_format: {"type": "text" | "json_object" | "json_schema", ...}."""
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError("response_format.json_schema must be {'name': ..., 'schema': {...}}")
        return StructuredOutputsParams(json=spec.get("schema") or _ANY_OBJECT)
    raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def extra_constraint(structured_outputs: dict | None) -> StructuredOutputsParams | None:
    """vLLM's `structured_outputs` request field: {"json": ..., "regex": ..., "choice": [...], ...}."""
    if not structured_outputs:
        return None
    if not isinstance(structured_outputs, dict):
        raise ValueError("structured_outputs must be an object such as {'regex': '...'}")
    fields = set(StructuredOutputsParams.__dataclass_fields__)
    unknown = sorted(set(structured_outputs) - fields)
    if unknown:
        raise ValueError(f"structured_outputs: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
    if not set(structured_outputs) & set(CONSTRAINT_KINDS):
        return None  # options only (disable_any_whitespace): they apply to the other constraint
    return StructuredOutputsParams(**structured_outputs)


def with_options(constraint: StructuredOutputsParams | None, structured_outputs: dict | None):
    """`constraint` with the option fields of a structured_outputs body that sets no constraint
    itself, e.g. {"disable_any_whitespace": true} next to response_format."""
    if constraint is None or not isinstance(structured_outputs, dict) or set(structured_outputs) & set(CONSTRAINT_KINDS):
        return constraint
    return dataclasses.replace(constraint, **structured_outputs)


# ---- prompts ----------------------------------------------------------------------------------


def _call_name_and_arguments(call, message: int, index: int) -> tuple[str, str]:
    """(name, arguments JSON text) of an assistant message's earlier tool call; ValueError (a 400)
    for a call that is not {"function": {"name": ..., "arguments": ...}}."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"messages[{message}].tool_calls[{index}] needs a 'function' with a non-empty 'name'")
    arguments = fn.get("arguments") or "{}"
    if not isinstance(arguments, str):
        raise ValueError(f"messages[{message}].tool_calls[{index}].function.arguments must be a JSON string")
    return fn["name"], arguments


def render_chat(hf_tokenizer: Any, messages: list[dict], plan: ToolPlan, parser: ToolParser,
                add_generation_prompt: bool) -> str:
    """The prompt for a chat with tools. A template that renders `tools` itself gets them (and
    the tool messages as they are); for one that ignores them (SmolLM2's does) the parser's
    system block is added to the system message, earlier calls are written in the parser's
    format and tool results are wrapped in <tool_response> tags, as Hermes-style models expect."""
    tools = plan.tools if plan.active else None
    if tools and _template_renders_tools(hf_tokenizer, tools):
        return hf_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                add_generation_prompt=add_generation_prompt)
    conversation = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m.get("tool_calls"):
            calls = "\n".join(parser.format_call(*_call_name_and_arguments(c, i, j))
                              for j, c in enumerate(m.pop("tool_calls")))
            m["content"] = f"{m.get('content') or ''}\n{calls}".strip()
        if m["role"] == "tool":
            m = {"role": "tool", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        conversation.append(m)
    if tools:
        block = parser.system_prompt(tools)
        if conversation and conversation[0]["role"] == "system":
            conversation[0] = {**conversation[0], "content": f"{conversation[0]['content']}\n\n{block}"}
        else:
            conversation.insert(0, {"role": "system", "content": block})
    return hf_tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)


def _template_renders_tools(hf_tokenizer: Any, tools: list[dict]) -> bool:
    probe = [{"role": "user", "content": "x"}]
    with_tools = hf_tokenizer.apply_chat_template(probe, tools=tools, tokenize=False)
    return with_tools != hf_tokenizer.apply_chat_template(probe, tokenize=False)
