"""Moving a sequence between engines: what travels (a `SequenceHandoff`) and the KV row copies.

Prefill/decode disaggregation (tessera.disagg) runs a prompt on one engine and its decode on
another. The prefill engine stops a request marked `handoff` right after its first token, copies
the K/V of the prompt out of its pool and hands back a SequenceHandoff; the decode engine imports
it (`LLMEngine.import_handoff`): it takes the longest cached prefix from its own prefix cache,
fresh blocks for the rest, copies in only the rows its cache lacked, registers the full blocks
under their prefix hashes (the same SHA-256 chain on every host) and decodes on.

The same object without K/V resumes a sequence whose engine died: the new engine recomputes
prompt and outputs (as after a recompute preemption) and streams on from where the client is.

K/V travel as one tensor [num_layers, 2 (k, v), num_tokens, num_kv_heads, head_dim]: exactly the
rows the prompt filled, not the padding of its last block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tessera.outputs import TokenLogprobs
from tessera.sampling import SamplingParams

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


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
    kv_shape: tuple[int, ...] = ()
    kv_dtype: str = ""


def token_slots(block_table: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Flat cache rows of token positions start .. end-1 of a sequence with this block table."""
    positions = torch.arange(start, end, dtype=torch.long)
    table = torch.tensor(block_table, dtype=torch.long)
    return table[positions // block_size] * block_size + positions % block_size


def kv_shape(kv_caches: KVCaches, num_tokens: int) -> tuple[int, ...]:
    k = kv_caches[0][0]
    return (len(kv_caches), 2, num_tokens, *k.shape[1:])


def read_kv(kv_caches: KVCaches, block_table: list[int], block_size: int, num_tokens: int,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy the K/V of a sequence's first num_tokens positions into `out` (or a new tensor)."""
    rows = token_slots(block_table, block_size, 0, num_tokens)
    if out is None:
        out = torch.empty(kv_shape(kv_caches, num_tokens), dtype=kv_caches[0][0].dtype)
    for layer, (k, v) in enumerate(kv_caches):
        torch.index_select(k, 0, rows, out=out[layer, 0])
        torch.index_select(v, 0, rows, out=out[layer, 1])
    return out


def write_kv(kv_caches: KVCaches, block_table: list[int], block_size: int, kv: torch.Tensor, start: int) -> None:
    """Write rows start .. of `kv` (a read_kv tensor) into the sequence's blocks; rows before
    `start` are already in the cache (a prefix-cache hit) and are not copied."""
    end = kv.shape[2]
    if start >= end:
        return
    rows = token_slots(block_table, block_size, start, end)
    for layer, (k, v) in enumerate(kv_caches):
        k.index_copy_(0, rows, kv[layer, 0, start:end].to(k.dtype))
        v.index_copy_(0, rows, kv[layer, 1, start:end].to(v.dtype))
