"""Moving a sequence between engines: what travels (a `SequenceHandoff`) and the KV row copies.

Prefill/decode disaggregation (tessera.disagg) runs a prompt on one engine and its decode on
another. The prefill engine stops a request marked `handoff` right after its first token, copies
the K/V of the prompt out of its pool and hands back a SequenceHandoff; the decode engine imports
it (`LLMEngine.import_handoff`): it takes the longest cached prefix from its own prefix cache,
fresh blocks for the rest, copies in only the rows its cache lacked, registers the full blocks
under their prefix hashes (the same SHA-256 chain on every host) and decodes on.

The same object without K/V resumes a sequence whose engine died: the new engine recomputes
prompt and outputs (as after a recompute preemption) and streams on from where the client is.

K/V travel as one flat byte buffer: for each layer, each of its cache tensors (k and v, plus
their scales when the cache is quantized, --kv-cache-dtype) contributes the rows of the tokens the
prompt filled, in token order; not the padding of its last block. Bytes keep every cache dtype
(bf16, int8 codes) transportable, and both engines must use the same cache layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tessera.outputs import TokenLogprobs
from tessera.sampling import SamplingParams

KVCaches = list[tuple[torch.Tensor, ...]]


@dataclass
class SequenceHandoff:
    """One sequence (n == 1) leaving an engine, as the next engine needs it."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # already sampled (the prefill's first token, or what a client got)
    params: SamplingParams
    num_kv_tokens: int = 0  # leading tokens whose K/V travel with it (0: recompute everything)
    emitted_text_len: int = 0  # characters of the output text the client already has
    output_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # The seeded sampler's state (torch.Generator.get_state()), so a seeded request samples on
    # exactly as it would have on one engine.
    generator_state: torch.Tensor | None = None
    kv_nbytes: int = 0


def token_slots(block_table: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Flat cache rows of token positions start .. end-1 of a sequence with this block table."""
    positions = torch.arange(start, end, dtype=torch.long)
    table = torch.tensor(block_table, dtype=torch.long)
    return table[positions // block_size] * block_size + positions % block_size


def kv_nbytes(kv_caches: KVCaches, num_tokens: int) -> int:
    """Bytes of the K/V (and scales) of num_tokens tokens across all layers."""
    return num_tokens * sum(t[0].numel() * t.element_size() for layer in kv_caches for t in layer)


def kv_parts(kv_caches: KVCaches, buffer: torch.Tensor, num_tokens: int) -> list[list[torch.Tensor]]:
    """Views of a handoff buffer (uint8) shaped like each cache tensor's rows: [layer][part]."""
    views, offset = [], 0
    for layer in kv_caches:
        row = []
        for t in layer:
            n = num_tokens * t[0].numel() * t.element_size()
            row.append(buffer[offset : offset + n].view(t.dtype).view(num_tokens, *t.shape[1:]))
            offset += n
        views.append(row)
    if offset != buffer.numel():
        raise ValueError(f"the K/V of {num_tokens} tokens take {offset} bytes in this engine's cache layout, but "
                         f"{buffer.numel()} bytes came: the engines differ in model or --kv-cache-dtype")
    return views


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as an integer dtype of the same size: row copies of an fp8 KV cache
    (--kv-cache-dtype fp8) go through uint8, since CPU index_copy_ has no float8 kernel."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def read_kv(kv_caches: KVCaches, block_table: list[int], block_size: int, num_tokens: int,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy the cache rows of a sequence's first num_tokens positions into `out` (a uint8 buffer
    of kv_nbytes, or a new one) and return it."""
    rows = token_slots(block_table, block_size, 0, num_tokens)
    if out is None:
        out = torch.empty(kv_nbytes(kv_caches, num_tokens), dtype=torch.uint8)
    for layer, views in zip(kv_caches, kv_parts(kv_caches, out, num_tokens), strict=True):
        for t, view in zip(layer, views, strict=True):
            t, view = _raw(t), _raw(view)
            if t.device == view.device:
                torch.index_select(t, 0, rows, out=view)
            else:  # an accelerator's pool into host memory
                view.copy_(t.index_select(0, rows.to(t.device)))
    return out


def write_kv(kv_caches: KVCaches, block_table: list[int], block_size: int, buffer: torch.Tensor, num_tokens: int,
             start: int) -> None:
    """Write rows start .. num_tokens-1 of a read_kv buffer into the sequence's blocks; rows
    before `start` are already in the cache (a prefix-cache hit) and are not copied."""
    views = kv_parts(kv_caches, buffer, num_tokens)
    if start >= num_tokens:
        return
    rows = token_slots(block_table, block_size, start, num_tokens).to(kv_caches[0][0].device)
    for layer, layer_views in zip(kv_caches, views, strict=True):
        for t, view in zip(layer, layer_views, strict=True):
            _raw(t).index_copy_(0, rows, _raw(view[start:num_tokens]).to(t.device))
