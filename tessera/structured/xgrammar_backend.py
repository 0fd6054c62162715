"""The xgrammar backend (the library vLLM and SGLang default to): compile and match constraints.

xgrammar builds a token-level automaton per grammar and caches, per automaton state, which
tokens are accepted; filling a sequence's mask is then microseconds for most states. Its error
messages start with a timestamp and a C++ source position, which are stripped here so that the
client reads only what was wrong.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch
import xgrammar as xgr

from tessera.structured.backend import GrammarMatcher, StructuredOutputBackend
from tessera.structured.params import StructuredOutputsParams

# Whitespace allowed in a row between JSON tokens (unless disable_any_whitespace): enough for
# indented output, few enough that a model cannot spin in whitespace until max_tokens.
MAX_WHITESPACE_RUN = 16
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


def _clean(exc: Exception) -> str:
    return _CPP_PREFIX.sub("", str(exc).strip()).splitlines()[0] if str(exc).strip() else repr(exc)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF whose only sentences are the given strings (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# Two defects of xgrammar 0.2.9 that let invalid JSON through, mended on the schema's EBNF text
# before it is compiled: a string with minLength/maxLength is a run of [^"\\\r\n], which admits
# raw control characters (U+0000-U+001F; RFC 8259 section 7 forbids them), and its character
# classes accept the UTF-8 encoding of surrogates (U+D800-U+DFFF), which is not UTF-8 at all
# (a byte-level model can emit it; Python decodes it to U+FFFD). Both classes are narrowed.
_LOOSE_STRING_CHARS = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\uD800-\uDFFF]'


def json_schema_ebnf(schema_text: str, **options: Any) -> str:
    """The EBNF of a JSON schema, with only characters JSON allows inside its strings."""
    text = str(xgr.Grammar.from_json_schema(schema_text, **options))
    for loose in _LOOSE_STRING_CHARS:
        text = text.replace(loose, _JSON_STRING_CHAR)
    return text


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._m = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()


class XGrammarBackend(StructuredOutputBackend):
    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        super().__init__(hf_tokenizer, vocab_size, stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # xgrammar's own cache is off: the manager caches compiled grammars by constraint.
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> Any:
        kind = params.kind
        whitespace = dict(any_whitespace=False) if params.disable_any_whitespace else dict(
            any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE_RUN)
        try:
            if kind == "json":
                return self._compiler.compile_grammar(json_schema_ebnf(params.schema_text, **whitespace))
            if kind == "json_object":
                # Any JSON object: the schema {"type": "object"} (the builtin JSON grammar would
                # also allow arrays and scalars, which OpenAI's json_object mode does not).
                return self._compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **whitespace)
            if kind == "regex":
                return self._compiler.compile_regex(params.regex)
            if kind == "choice":
                return self._compiler.compile_grammar(choice_grammar(params.choice))
            return self._compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"structured_outputs.{kind}: {_clean(exc)}") from None

    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled))
