"""Tool-call parsers: a model's text -> OpenAI tool calls, selected by --tool-call-parser.

Names as vLLM's: "hermes" (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks,
used by Hermes, Qwen 2/2.5/3 and SmolLM-style templates) and "llama3_json" (Llama 3.x: a bare
`{"name": ..., "parameters": {...}}` object, several separated by ";", optionally after
`<|python_tag|>`). Each parser also writes the system block that tells a model whose chat
template ignores `tools` how to call them, and renders earlier calls back into its format.
A parser is torch-free and stateless; the streaming side is StreamingToolCalls.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def _arguments_text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class ToolParser(ABC):
    name: str
    start_marker: str  # text that opens a tool call; content before it streams as text

    @abstractmethod
    def system_prompt(self, tools: list[dict]) -> str: ...

    @abstractmethod
    def format_call(self, name: str, arguments: str) -> str:
        """An earlier assistant call, as the model would have written it."""

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content outside the calls or None, calls); text that does not parse stays content."""


class HermesToolParser(ToolParser):
    name = "hermes"
    start_marker = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def system_prompt(self, tools: list[dict]) -> str:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("You are a function calling AI model. You are provided with function signatures within <tools></tools> "
                "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
                f"about what values to plug into functions. Here are the available tools: <tools>\n{listing}\n</tools>\n"
                "For each function call return a json object with function name and arguments within <tool_call>"
                "</tool_call> XML tags as follows:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def format_call(self, name: str, arguments: str) -> str:
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments or "{}"}}}\n</tool_call>'

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        if self.start_marker not in text:
            return text, []
        calls = []
        for match in self._BLOCK.finditer(text):
            try:
                obj = json.loads(match.group(1))
            except json.JSONDecodeError:
                return text, []  # a malformed call: give the text back rather than half of it
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return text, []
            calls.append(ParsedToolCall(obj["name"], _arguments_text(obj.get("arguments", {}))))
        content = text[: text.index(self.start_marker)].strip()
        return content or None, calls


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_marker = "{"
    _PYTHON_TAG = "<|python_tag|>"

    def system_prompt(self, tools: list[dict]) -> str:
        listing = "\n\n".join(json.dumps(t, indent=4, ensure_ascii=False) for t in tools)
        return ("Given the following functions, please respond with a JSON for a function call with its proper "
                "arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, "
                "\"parameters\": dictionary of argument name and its value}. Do not use variables.\n\n" + listing)

    def format_call(self, name: str, arguments: str) -> str:
        return f'{{"name": {json.dumps(name)}, "parameters": {arguments or "{}"}}}'

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        body = text.strip().removeprefix(self._PYTHON_TAG).strip()
        if not body.startswith("{"):
            return text, []
        decoder = json.JSONDecoder()
        calls, pos = [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return text, []
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return text, []
            args = obj.get("parameters", obj.get("arguments", {}))
            calls.append(ParsedToolCall(obj["name"], _arguments_text(args)))
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return None, calls


def get_tool_parser(name: str) -> ToolParser:
    if name == "hermes":
        return HermesToolParser()
    if name == "llama3_json":
        return Llama3JsonToolParser()
    raise ValueError(f"--tool-call-parser {name!r}: choose one of {', '.join(TOOL_CALL_PARSERS)}")


class StreamingToolCalls:
    """One streamed choice of a tools="auto" request: text streams as content until the parser's
    start marker appears (held back while the text could still be the marker's beginning);
    from there on the text is held and parsed when the choice ends, and each call goes out as
    one delta carrying its id, name and complete arguments."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._sent = 0  # characters of text already streamed as content
        self._in_call = False

    def feed(self, delta: str) -> str:
        """Add a text delta; return the part that can go out as content now."""
        self.text += delta
        if self._in_call:
            return ""
        marker = self.parser.start_marker
        at = self.text.find(marker, self._sent)
        if self.parser.name == "llama3_json":
            # A Llama 3 call is the whole message: only leading whitespace may precede it.
            stripped = self.text.lstrip()
            if stripped.startswith(("{", "<|python_tag|>")) or (stripped and "<|python_tag|>".startswith(stripped)):
                self._in_call = True
                return ""
            if not stripped:
                return ""
            at = -1
        if at >= 0:
            self._in_call = True
            out, self._sent = self.text[self._sent : at], at
            return out
        hold = next((k for k in range(min(len(marker) - 1, len(self.text) - self._sent), 0, -1)
                     if marker.startswith(self.text[-k:])), 0)
        end = len(self.text) - hold
        out, self._sent = self.text[self._sent : end], max(self._sent, end)
        return out

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """At the end: (content still to send, the calls)."""
        content, calls = self.parser.parse(self.text)
        if not calls:
            rest, self._sent = self.text[self._sent :], len(self.text)
            return rest, []
        return "", calls
