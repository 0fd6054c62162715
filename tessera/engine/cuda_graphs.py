"""Decode steps replayed from CUDA graphs, one captured per batch-size bucket.

A decode step of a small model on a GPU is a few hundred short kernels; launched one by one from
Python, the launches take longer than the kernels run. So at start-up the runner captures the
model's decode forward (embedding, every layer, the final norm and the lm_head) once for each
bucket of `capture_sizes`, on fixed input buffers, and a decode-only step of b sequences copies
its inputs into those buffers, replays the graph of the smallest bucket >= b and reads the first
b rows of its logits, as vLLM pads a batch to its capture sizes.

What the graph reads must live at fixed addresses, so the inputs are buffers sized for the
largest bucket: token ids, positions, the slot each new K/V goes to, the block tables (as wide
as max_model_len) and the context lengths. The decode slots are computed from the block tables
inside the graph. Padding rows write no K/V (slot -1, which the Triton kernel skips) and attend
to nothing (context length 0), so they touch no sequence's cache and stay finite. The Triton
backend derives nothing on the host for a decode step, which is what lets it be captured.

Steps with prefill chunks or speculative proposals, and batches over the largest bucket, run
eagerly; `--enforce-eager` turns the graphs off. `capture=False` runs the same padded forward
without a graph, which is how CI tests the padding on CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import logging
import time

import torch

from tessera.attention.metadata import AttentionMetadata

logger = logging.getLogger("tessera")

MAX_CAPTURE_SIZE = 256  # vLLM's default largest capture size too


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch-size buckets: 1, 2, 4, then every multiple of 8, up to max_num_seqs (at most 256),
    which is always one of them."""
    top = max(1, min(max_num_seqs, MAX_CAPTURE_SIZE))
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, top, 8))
    return sizes + [top]


class DecodeGraphs:
    """Captured decode forwards over fixed buffers; `run(step)` replays one or says no (None)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, block_size: int, max_model_len: int,
                 max_num_seqs: int, capture: bool = True) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        self.capture = capture
        device = kv_caches[0][0].device
        top = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(top, self.max_blocks, dtype=torch.long, device=device)
        self.context_lens = torch.zeros(top, dtype=torch.int32, device=device)
        self._block_offsets = torch.arange(block_size, dtype=torch.long, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}

    def capture_all(self) -> float:
        """Warm up and capture every bucket, largest first so the smaller graphs reuse its
        memory pool; returns the seconds it took."""
        started = time.perf_counter()
        # Row 0 at the last position grows every rotary table to max_model_len before capture.
        self.positions[0] = self.max_model_len - 1
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # compiles the Triton kernels for this shape outside the capture
            if not self.capture:
                continue
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[size] = self._forward(size)
            pool = graph.pool()
            self._graphs[size] = graph
        self.positions.zero_()
        if self.capture:
            torch.cuda.synchronize()
        return time.perf_counter() - started

    def _forward(self, size: int) -> torch.Tensor:
        tables = self.block_tables[:size]
        slots = (tables.unsqueeze(-1) * self.block_size + self._block_offsets).view(size, -1)
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            num_decode_tokens=size,
            decode_slots=slots,
            decode_mask=None,
            prefills=[],
            block_size=self.block_size,
            decode_block_tables=tables,
            decode_context_lens=self.context_lens[:size],
        )
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, metadata)
        return self.model.compute_logits(hidden)

    def bucket(self, batch: int) -> int | None:
        """The smallest capture size >= batch, None past the largest."""
        return next((s for s in self.sizes if s >= batch), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor | None:
        """Float32 logits [b, vocab] of a decode-only step of b sequences (host tensors as the
        runner builds them), or None when the step is not one a graph covers."""
        batch = metadata.num_decode_tokens
        if metadata.prefills or batch == 0 or metadata.num_tokens != batch:
            return None
        size = self.bucket(batch)
        tables = metadata.decode_block_tables
        if size is None or tables is None or metadata.decode_context_lens is None or tables.shape[1] > self.max_blocks:
            return None
        self.input_ids[:batch].copy_(input_ids, non_blocking=True)
        self.positions[:batch].copy_(positions, non_blocking=True)
        self.slot_mapping[:batch].copy_(metadata.slot_mapping, non_blocking=True)
        self.context_lens[:batch].copy_(metadata.decode_context_lens, non_blocking=True)
        self.block_tables[:batch, : tables.shape[1]].copy_(tables, non_blocking=True)
        if size > batch:  # padding rows: write nothing, attend to nothing
            self.slot_mapping[batch:size].fill_(-1)
            self.context_lens[batch:size].zero_()
        if self.capture:
            self._graphs[size].replay()
            logits = self._logits[size]
        else:
            logits = self._forward(size)
        # A copy: the next replay overwrites the graph's output while the caller may still hold it.
        return logits[:batch].clone()
