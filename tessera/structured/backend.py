"""The contract between the engine and a structured-output library, and the backend registry.

A backend compiles a constraint once (slow: milliseconds to seconds, done on a worker thread and
cached by the manager) and makes a cheap matcher per sequence from the compiled grammar. A
matcher tracks one sequence's position in the grammar: it writes the tokens allowed next into
one row of a packed bitmask (int32 words, bit j of word w = token 32 w + j, 1 = allowed),
accepts the token that was chosen, and can roll back tokens it accepted (speculative proposals
are walked through the matcher to mask their verification rows, then undone).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from tessera.structured.params import StructuredOutputsParams

STRUCTURED_OUTPUT_BACKENDS = ("xgrammar",)


class GrammarMatcher(ABC):
    """One sequence's state in a compiled grammar."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) if the grammar does not allow it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (int32 [R, ceil(V/32)], CPU)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""


class StructuredOutputBackend(ABC):
    """Compiles constraints for one tokenizer. compile() may run on any thread."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of `params`; raises ValueError naming what is wrong with it."""

    @abstractmethod
    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of `compiled`."""


def create_backend(name: str, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> StructuredOutputBackend:
    if name == "xgrammar":
        from tessera.structured.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(hf_tokenizer, vocab_size, stop_token_ids)
    raise ValueError(f"--structured-outputs-backend {name!r}: choose one of {', '.join(STRUCTURED_OUTPUT_BACKENDS)}")
