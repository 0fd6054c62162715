"""Text <-> token ids for one model, and the incremental detokenizer used for streaming.

`Tokenizer` wraps transformers' AutoTokenizer, which reads both a Hugging Face folder and the
vocabulary embedded in a GGUF file. Loading takes seconds (GGUF vocabularies are converted on the
fly), so an engine builds one `Tokenizer` at start-up and shares it; nothing is cached globally.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

from tessera.config import ModelConfig

logger = logging.getLogger("tessera")


class Tokenizer:
    """The tokenizer of the model at `path` (a Hugging Face folder, or a .gguf file)."""

    def __init__(self, path: str | os.PathLike, config: ModelConfig | None = None,
                 chat_template: str | None = None) -> None:
        """chat_template: --chat-template (a file or the Jinja text) in place of the model's own."""
        from transformers import AutoTokenizer

        path = Path(path)
        if path.is_dir() and not (path / "config.json").is_file() and len(ggufs := sorted(path.glob("*.gguf"))) == 1:
            path = ggufs[0]
        logger.info("loading tokenizer from %s", path)
        if path.is_file():
            self.hf = _load_gguf_tokenizer(path)
        else:
            self.hf = AutoTokenizer.from_pretrained(path)
        self.path = path
        if chat_template is not None:
            from tessera.config import chat_template_text

            self.hf.chat_template = chat_template_text(chat_template)
        # The tokenizers backend decodes without transformers' per-call overhead, which matters
        # when the detokenizer decodes a few tokens for every generated token.
        backend = getattr(self.hf, "backend_tokenizer", None)
        self._backend_decode = backend.decode if backend is not None else None
        eos = {self.hf.eos_token_id} if self.hf.eos_token_id is not None else set()
        self.eos_token_ids: frozenset[int] = frozenset(eos | set(config.eos_token_ids if config else ()))

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (base vocabulary plus added tokens)."""
        return len(self.hf)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Pass add_special_tokens=False for text that came out of
        apply_chat_template: the template already wrote the BOS where the model wants one."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`, without transformers' clean_up_tokenization_spaces (which rewrites
        " ." into "." and so would not agree with the streamed text)."""
        ids = list(ids)
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for a chat, rendered with the model's own template."""
        if not self.hf.chat_template:
            raise ValueError(
                f"the model at {self.path} has no chat template, so chat requests cannot be "
                f"formatted; send a plain prompt (the completions API) instead"
            )
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _load_gguf_tokenizer(path: Path):
    """transformers converts a GGUF vocabulary to a fast tokenizer in tens of seconds; keep the
    converted tokenizer beside the model cache, keyed by the file's size and mtime, and load that
    (well under a second) from then on."""
    from transformers import AutoTokenizer

    from tessera.model.download import cache_dir

    st = path.stat()
    converted = cache_dir() / "tokenizers" / f"{path.stem}-{st.st_size}-{int(st.st_mtime)}"
    if (converted / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(converted)
        except (OSError, ValueError) as e:  # a damaged cache entry: convert again
            logger.warning("ignoring the cached tokenizer at %s: %s", converted, e)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    try:
        tmp = converted.with_name(converted.name + f".tmp{os.getpid()}")
        tok.save_pretrained(tmp)
        os.replace(tmp, converted)
    except OSError as e:  # a read-only cache only costs time
        logger.warning("could not cache the converted tokenizer at %s: %s", converted, e)
    return tok


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas.

    Decoding each new token alone is wrong: a UTF-8 character may span several byte-level tokens,
    and SentencePiece drops the leading space of a text's first token. So each step decodes a
    short window twice, `ids[prefix_offset:read_offset]` (already emitted) and
    `ids[prefix_offset:]`, and emits the difference. The delta is held back while the window ends
    in U+FFFD, an incomplete character that the next token may complete.

    The concatenation of all deltas plus `flush()` equals `tokenizer.decode(output_ids)` for
    byte-level BPE vocabularies. Prompt tokens give the first window its left context; for
    SentencePiece vocabularies that keeps the space before the first generated word, which a
    decode of the output alone would drop.
    """

    # Prompt tokens the first window starts with: enough for any decoder's start-of-text effects.
    CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Only a window of ids is kept: ids[prefix_offset:read_offset] is text already emitted
        # (or prompt context), ids[read_offset:] is not yet emitted.
        self.token_ids = list(prompt_token_ids[-self.CONTEXT_TOKENS :])
        if self._decode(0, len(self.token_ids)).endswith("\ufffd"):
            # The prompt ends inside a character; its missing bytes in the output would complete
            # it and put prompt text into the output. Start without context instead.
            self.token_ids = []
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""  # everything emitted so far

    def append(self, token_ids: int | Iterable[int]) -> str:
        """Add generated token(s); return the text they complete (possibly "")."""
        self.token_ids.extend([token_ids] if isinstance(token_ids, int) else token_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset, len(self.token_ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        return self._emit(new_text[len(prefix_text) :])

    def flush(self) -> str:
        """At the end of the stream: the held-back text, even if it ends in an invalid character."""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset, len(self.token_ids))
        return self._emit(new_text[len(prefix_text) :]) if len(new_text) > len(prefix_text) else ""

    def _emit(self, delta: str) -> str:
        # The next window starts where this one's emitted text starts; ids before it are never
        # decoded again, so drop them and keep the list a few tokens long.
        del self.token_ids[: self.read_offset]
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens)
