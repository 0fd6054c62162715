"""Per-step attention metadata: the only thing attention layers know about the batch.

The model runner builds one `AttentionMetadata` per step from the scheduler's decisions; every
layer of the model reads it. Layers never see scheduler objects.

Token layout of a step (the flattened batch, T tokens in all):

    [ decode tokens: one per decoding sequence | prefill spans: each a run of prompt tokens ]

The KV cache of one layer is a pair of tensors `(k_cache, v_cache)`, each of shape
`[num_slots, num_kv_heads, head_dim]` with `num_slots = num_blocks * block_size`. A token that
sits at position `p` of a sequence lives in slot `block_table[p // block_size] * block_size +
p % block_size`. Slot 0 .. block_size-1 (block 0) is never handed to a sequence: padding indices
point there, so a gather with padding never reads another sequence's data by accident.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class PrefillSpan:
    """One sequence's chunk of new (prompt) tokens in this step.

    `query_start:query_start+query_len` indexes the step's flattened tokens. The chunk's tokens
    sit at positions `context_len - query_len .. context_len - 1` of the sequence, so it attends
    causally to everything before it (earlier chunks, cached prefix) and to itself.
    """

    query_start: int
    query_len: int
    context_len: int  # tokens of context after this step's tokens are written (incl. the chunk)
    context_slots: torch.Tensor  # [context_len] long: cache slot of each context position
    # The sequence's blocks covering the context ([ceil(context_len / block_size)] long), for
    # backends that walk block tables; None = derive them from context_slots.
    block_table: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: the cache slot where each new token's K/V is written
    num_decode_tokens: int  # the first num_decode_tokens tokens are decodes, one per sequence
    # Decodes, batched: context slots padded to the longest context (padding points at slot 0).
    decode_slots: torch.Tensor | None  # [num_decodes, max_context] long
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_context] bool, True = attend
    prefills: list[PrefillSpan]
    # Leading context positions every decode reads from the same slots (a shared prefix-cached
    # prompt); 0 = none. Backends may gather them once (tessera.attention.cascade) or ignore it.
    decode_shared_len: int = 0
    # Tokens per KV block, for backends that walk block tables (the invariant kernel derives
    # them from the slots); None = unknown, such backends fall back to the slot gathers.
    block_size: int | None = None
    # The decodes' block tables ([num_decodes, max_blocks] long, padded with block 0) and context
    # lengths ([num_decodes] long), as the model runner built them; None = derive them from
    # decode_slots / decode_mask (one tensor op each, but the runner has them already).
    decode_block_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    def to(self, device: torch.device) -> AttentionMetadata:
        """This metadata with every tensor on `device` (the runner builds them on the host)."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return replace(
            self,
            slot_mapping=self.slot_mapping.to(device),
            decode_slots=move(self.decode_slots),
            decode_mask=move(self.decode_mask),
            prefills=[replace(span, context_slots=span.context_slots.to(device), block_table=move(span.block_table))
                      for span in self.prefills],
            decode_block_tables=move(self.decode_block_tables),
            decode_context_lens=move(self.decode_context_lens),
        )


class DecodeTablesMetadata(AttentionMetadata):
    """AttentionMetadata whose decode_slots and decode_mask are made from decode_block_tables and
    decode_context_lens when first read (the model runner's; a reader may also set them). The
    invariant CPU kernel walks the block tables and never reads them: the dense [decodes,
    max_context] tensors were ~0.1 ms of a 32-decode step's preparation, for nothing there."""

    _decode_slots: torch.Tensor | None = None
    _decode_mask: torch.Tensor | None = None

    @property
    def decode_slots(self) -> torch.Tensor | None:
        if self._decode_slots is None and self.num_decode_tokens and self.decode_block_tables is not None:
            tables, bs = self.decode_block_tables, self.block_size
            offsets = torch.arange(bs, dtype=tables.dtype, device=tables.device)
            slots = (tables.unsqueeze(-1) * bs + offsets).view(tables.shape[0], -1)
            self._decode_slots = slots[:, : self._max_context()].contiguous()
        return self._decode_slots

    @decode_slots.setter
    def decode_slots(self, value: torch.Tensor | None) -> None:
        self._decode_slots = value

    @property
    def decode_mask(self) -> torch.Tensor | None:
        if self._decode_mask is None and self.num_decode_tokens and self.decode_context_lens is not None:
            lens, width = self.decode_context_lens, self._max_context()
            mask = torch.arange(width, device=lens.device) < lens.unsqueeze(1)
            self._decode_mask = mask.view(lens.shape[0], 1, 1, width)
        return self._decode_mask

    @decode_mask.setter
    def decode_mask(self, value: torch.Tensor | None) -> None:
        self._decode_mask = value

    def _max_context(self) -> int:
        return int(self.decode_context_lens.max())


def slots_for_positions(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions start..end-1 of a sequence whose blocks are `block_table`."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def single_sequence_metadata(num_tokens: int, block_size: int = 16, first_block: int = 1) -> AttentionMetadata:
    """Metadata for one sequence prefilled from scratch into contiguous blocks starting at
    `first_block`: what tests and simple tools need without the scheduler."""
    num_blocks = (num_tokens + block_size - 1) // block_size
    table = list(range(first_block, first_block + num_blocks))
    slots = torch.tensor(slots_for_positions(table, 0, num_tokens, block_size), dtype=torch.long)
    return AttentionMetadata(
        slot_mapping=slots,
        num_decode_tokens=0,
        decode_slots=None,
        decode_mask=None,
        prefills=[PrefillSpan(0, num_tokens, num_tokens, slots, torch.tensor(table, dtype=torch.long))],
        block_size=block_size,
    )
