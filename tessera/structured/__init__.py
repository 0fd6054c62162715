"""Structured outputs: constraints (JSON schema, regex, choice, grammar) enforced as token masks.

params.py      what a request asks for (StructuredOutputsParams; torch-free, the server imports it)
backend.py     the backend contract (compile a constraint, a matcher per sequence) and its registry
xgrammar_backend.py  the default backend, on the xgrammar library
bitmask.py     applying a packed token bitmask to a batch of logits in one tensor operation
manager.py     the engine's side: compile off the step loop, cache by constraint, matchers, masks
tools.py       OpenAI tools -> prompt text and JSON-schema constraints ("required", named function)
tool_parsers.py  model output -> tool calls (hermes, llama3_json), whole and streamed
"""

from tessera.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
