"""Paged attention with the batch-invariant C++ kernel (tessera/kernels), the CPU default.

Every query row (a decode, a prefill chunk's token, a speculative verification row) attends to
its own context through the block table, in place (no gathered copy of the context), in fixed
16-position tiles with an fp32 online softmax. A row's output therefore does not depend on the
batch, on where a prefill chunk starts, or on whether its prefix came from the cache.

Sliding-window layers (Mistral, Gemma 3's local layers) pass their window to the kernel, which
reads only the keys inside each row's window (blocks behind it may be block 0). Quantized KV
caches (--kv-cache-dtype int8/fp8) are dequantized in the kernel as it reads them (codes times
the fp32 scale of their slot and KV head), so they are invariant too. Head dims the kernel has
no instance for, and non-CPU tensors, go through the plain torch backend this class extends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera import kernels
from tessera.attention.metadata import AttentionMetadata
from tessera.attention.torch_cpu import TorchCPUAttention
from tessera.quant.kv import is_quantized, write_quantized

_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)

# The kernel's arithmetic for bf16 q and cache with head_dim a multiple of 32: -1 the CPU's best
# (AMX tiles where it has them, else AVX-512 BF16 pair dot products for the scores where it has
# those, else fp32 AVX-512); 0 always the fp32 AVX-512 one; 1 AMX and 2 the pairs, required
# (tests and benchmarks compare them). Other dtypes and head_dims take the fp32 AVX-512 one.
AMX = -1


@dataclass
class _KernelPlan:
    metadata: AttentionMetadata
    block_tables: torch.Tensor  # [rows, max_blocks] int32: one row per decode, then per prefill span
    token_row: torch.Tensor  # [T] int32: each token's row of block_tables
    token_ctx: torch.Tensor  # [T] int32: context positions each token attends to (its own included)


def _kernel_plan(metadata: AttentionMetadata) -> _KernelPlan:
    """The kernel's tables, once per step: the decodes' block tables and context lengths as the
    model runner built them (else one tensor op each from the slots), then one table row per
    prefill span. A handful of tensor ops whatever the batch size."""
    block_size = metadata.block_size
    parts: list[torch.Tensor] = []  # 2-D block-table pieces, stacked in row order
    rows: list[torch.Tensor] = []
    ctxs: list[torch.Tensor] = []
    num_decodes = metadata.num_decode_tokens
    if num_decodes:
        if metadata.decode_block_tables is not None and metadata.decode_context_lens is not None:
            parts.append(metadata.decode_block_tables)
            ctxs.append(metadata.decode_context_lens.to(torch.int32))
        else:
            slots = metadata.decode_slots
            parts.append(slots[:, ::block_size] // block_size)
            mask = metadata.decode_mask
            ctxs.append(mask.reshape(num_decodes, -1).sum(-1, dtype=torch.int32) if mask is not None
                        else torch.full((num_decodes,), slots.shape[1], dtype=torch.int32))
        rows.append(torch.arange(num_decodes, dtype=torch.int32))
    num_rows = num_decodes
    for span in metadata.prefills:
        table = (span.block_table if span.block_table is not None
                 else span.context_slots[: span.context_len : block_size] // block_size)
        rows.append(torch.full((span.query_len,), num_rows, dtype=torch.int32))
        parts.append(table.view(1, -1))
        num_rows += 1
        first = span.context_len - span.query_len + 1
        ctxs.append(torch.arange(first, first + span.query_len, dtype=torch.int32))
    if len(parts) == 1:
        table = parts[0].to(torch.int32).contiguous()
    else:
        width = max(t.shape[1] for t in parts)
        table = torch.zeros(num_rows, width, dtype=torch.int32)
        at = 0
        for t in parts:
            table[at : at + t.shape[0], : t.shape[1]] = t
            at += t.shape[0]
    return _KernelPlan(metadata, table,
                       rows[0] if len(rows) == 1 else torch.cat(rows),
                       ctxs[0] if len(ctxs) == 1 else torch.cat(ctxs))


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [T, Hkv, d] whose every token's [Hkv, d] is one contiguous row (views into the fused qkv
    output already are), as write_kv copies rows."""
    return x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous()


class InvariantCPUAttention(TorchCPUAttention):
    name = "invariant"
    supports_quantized_kv = True

    def __init__(self) -> None:
        super().__init__()
        self._kernel_plan: _KernelPlan | None = None

    def begin_step(self, metadata: AttentionMetadata) -> None:
        super().begin_step(metadata)
        self._kernel_plan = None

    def reads_shared_prefix(self, head_dim: int) -> bool:
        # The kernel reads a shared prefix in place; only the torch fallback takes the cascade.
        return head_dim not in _HEAD_DIMS or not kernels.available()

    def kernel_plan(self, metadata: AttentionMetadata) -> _KernelPlan:
        """The kernel's tables for this step, built once and shared by every layer (and by the
        native decoder stack, tessera/model/native_stack.py)."""
        plan = self._kernel_plan
        if plan is None or plan.metadata is not metadata:
            plan = self._kernel_plan = _kernel_plan(metadata)
        return plan

    def forward(self, layer_idx, q, k, v, kv_cache, metadata, scale, sliding_window=None):
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        quantized = is_quantized(kv_cache)
        if (q.shape[-1] not in _HEAD_DIMS or (k_cache.dtype != q.dtype and not quantized)
                or q.device.type != "cpu" or not kernels.available() or metadata.block_size is None):
            return super().forward(layer_idx, q, k, v, kv_cache, metadata, scale, sliding_window)
        if quantized:
            k_scales, v_scales = kv_cache[2], kv_cache[3]
            write_quantized(kv_cache, k, v, metadata.slot_mapping, q.dtype)  # codes + scales; reads dequantize
        else:
            k_scales = v_scales = None
            k, v = _rows_contiguous(k), _rows_contiguous(v)
            kernels.ops().write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)  # one call, both caches
        plan = self.kernel_plan(metadata)
        return kernels.ops().paged_attention(q, k_cache, v_cache, plan.block_tables, plan.token_row,
                                             plan.token_ctx, metadata.block_size, scale, sliding_window or 0,
                                             k_scales, v_scales, AMX)
