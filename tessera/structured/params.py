"""StructuredOutputsParams: the constraint one request puts on its output, as vLLM spells it.

Exactly one of json (a JSON schema, as a dict or JSON text), regex, choice (a list of strings),
grammar (EBNF, xgrammar's dialect) or json_object (any JSON object) is set. The object is
checked when built (shape only: whether a schema or regex compiles is the backend's verdict,
see StructuredOutputManager.compile). Torch-free: the HTTP server imports it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's switch: JSON with no whitespace between tokens (otherwise some is allowed, capped
    # per run so a model cannot spin in whitespace until max_tokens).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(CONSTRAINT_KINDS)}, "
                             f"got {', '.join(given) if given else 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its JSON text), "
                             f"got {type(self.json).__name__}")
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema object")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if (isinstance(self.choice, str) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object not in (None, True, False):
            raise ValueError("structured_outputs.json_object must be a bool")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a bool")

    @property
    def kind(self) -> str:
        return next(k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False))

    @property
    def schema_text(self) -> str | None:
        """The JSON schema as canonical text (sorted keys), or None for other kinds."""
        if self.json is None:
            return None
        schema = json.loads(self.json) if isinstance(self.json, str) else self.json
        return json.dumps(schema, sort_keys=True, separators=(",", ":"))

    def cache_key(self) -> tuple:
        """Equal for constraints that compile to the same grammar (the compile cache's key)."""
        kind = self.kind
        if kind == "json":
            value: object = self.schema_text
        elif kind == "json_object":
            value = True
        else:
            value = getattr(self, kind)
        return kind, value, self.disable_any_whitespace
