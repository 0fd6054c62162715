"""The model runner: turns the scheduler's decisions into tensors, runs the model, returns logits.

This is the only place where engine objects (Sequences, block tables) become tensors. The
model and its attention layers see a flattened batch and an `AttentionMetadata`, nothing else.
Everything the layers share (slot mappings, decode gather indices, masks) is built here once
per step, never once per layer.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, replace

import torch

from tessera.attention.cascade import shared_prefix_len
from tessera.attention.metadata import AttentionMetadata, DecodeTablesMetadata, PrefillSpan
from tessera.engine.request import Sequence
from tessera.engine.swap import HostKVCache
from tessera.quant.kv import allocate_kv_cache

logger = logging.getLogger("tessera")


def prepare_step_kernels(model: torch.nn.Module, config, dtype: torch.dtype, files=None) -> int:
    """Put the batch-invariant linear kernels (tessera/kernels) in the model where they pay.

    bf16 where the CPU has AVX-512 BF16 (AMX tiles or VDPBF16PS): always (as fast as oneDNN at
    prefill sizes and faster at decode sizes, measured on both). float32: on CPUs with AVX2 and
    no AVX-512 (Zen 3: the register-tiled kernel beats MKL at every row count), elsewhere only
    with --deterministic (the fixed-order FMA kernel is slower than MKL's prefill GEMM there;
    docs/reproducibility.md has the measured cost). Returns how many weights
    were swapped. `files` (the model's ModelFiles): a GGUF model also keeps its blocks for decode
    sizes, in bf16 on AVX-512 BF16 CPUs (tessera/quant/gguf_codes.py), in float32 on the AVX2 tiles
    (tessera/quant/gguf_f32_blocks.py)."""
    from tessera.kernels.linear import invariant_by_default, make_linears_invariant, supported

    if config.device != "cpu":
        return 0
    if not supported(dtype):
        if config.deterministic:
            raise ValueError(f"--deterministic needs the batch-invariant kernels, which this CPU has not for "
                             f"{str(dtype).removeprefix('torch.')} (bf16 needs AVX-512 BF16 or AMX): use --dtype float32")
        return 0
    if dtype == torch.bfloat16 or config.deterministic or invariant_by_default(dtype):
        count = make_linears_invariant(model)
        if dtype == torch.bfloat16 and files is not None:
            from tessera.quant.gguf_codes import attach_gguf_codes

            attach_gguf_codes(model, files)
        if dtype == torch.float32 and files is not None:
            from tessera.quant.gguf_f32_blocks import attach_f32_blocks

            attach_f32_blocks(model, files)
        if not config.enforce_eager and hasattr(model, "native_stack"):
            from tessera.model.native_stack import build_native_stack

            model.native_stack = build_native_stack(model)
            if model.native_stack is not None:
                logger.info("decoder stack: one native call per step (--enforce-eager: the module path)")
        return count
    return 0


@dataclass
class StepInput:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    metadata: AttentionMetadata
    sample_rows: torch.Tensor  # [S] long: rows of the hidden states whose logits are sampled
    sample_seqs: list[Sequence]  # the S sequences that sample a token this step, in row order


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 kv_cache_dtype: str = "auto") -> None:
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Per layer (k, v), or (k codes, v codes, k scales, v scales) for --kv-cache-dtype int8/fp8.
        self.kv_caches = allocate_kv_cache(model, num_blocks, block_size, kv_cache_dtype)
        # The host KV tier (--swap-space): same layout, blocks copied in and out by swap_blocks.
        self.host_kv = HostKVCache(self.kv_caches, num_host_blocks, block_size) if num_host_blocks else None
        self._block_offsets = torch.arange(block_size, dtype=torch.long)
        # Only the cascade decode reads the shared-prefix length: ~0.1 ms of a 32-sequence step's
        # preparation saved for the others (a model without a backend or config keeps measuring it).
        reads = getattr(getattr(model, "attn_backend", None), "reads_shared_prefix", None)
        config = getattr(model, "config", None)
        self._measure_shared_prefix = reads is None or config is None or reads(config.head_dim)
        self.device = self.kv_caches[0][0].device
        self.decode_graphs = None  # tessera.engine.cuda_graphs.DecodeGraphs, once captured
        # The last logits' column maxima from the lm_head's kernel (chunk_maxima), with the logits
        # they belong to (a weak reference).
        self._maxima: tuple[weakref.ref, torch.Tensor] | None = None

    def capture_decode_graphs(self, max_model_len: int, max_num_seqs: int, capture: bool = True) -> None:
        """Capture the decode forward in CUDA graphs, one per batch-size bucket (see
        tessera/engine/cuda_graphs.py); decode-only steps replay them from then on. A model whose
        step cannot be captured (a kernel that syncs with the host) keeps running eagerly."""
        from tessera.engine.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, max_model_len, max_num_seqs, capture)
        try:
            seconds = graphs.capture_all()
        except Exception as exc:  # noqa: BLE001 - any capture failure leaves the eager path, which works
            logger.warning("CUDA graphs not captured (%s: %s); decode steps run eagerly", type(exc).__name__, exc)
            return
        self.decode_graphs = graphs
        logger.info("CUDA graphs: decode batch sizes %s captured in %.1fs (--enforce-eager: none)",
                    graphs.sizes, seconds)

    def swap_blocks(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Run a step's block copies before its forward pass: (device, host) pairs out, then
        (host, device) pairs in, each a batched copy per layer and tensor."""
        if swap_out or swap_in:
            self.host_kv.swap_out(self.kv_caches, swap_out)
            self.host_kv.swap_in(self.kv_caches, swap_in)

    def prepare(self, scheduled: list[tuple[Sequence, int]], num_decodes: int,
                spec_tokens: dict[int, list[int]] | None = None) -> StepInput:
        """Build the step's tensors. `scheduled` lists (sequence, new tokens), decodes first.

        spec_tokens (speculative decoding): seq_id -> proposed tokens. Such a sequence (after the
        decodes) runs its last token and the proposals as one causal query and samples at every
        row: it appears once in sample_seqs per row, k+1 times in a row.
        """
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []

        # Decodes: one token each, at position num_computed_tokens (the last token).
        decode_seqs = [seq for seq, _ in scheduled[:num_decodes]]
        tables = lens = None
        decode_shared_len = 0
        slot_parts: list[torch.Tensor] = []
        if decode_seqs:
            ctx_lens = [seq.num_computed_tokens + 1 for seq in decode_seqs]
            input_ids.extend(seq.last_token_id for seq in decode_seqs)
            positions.extend(n - 1 for n in ctx_lens)
            max_blocks = max(len(seq.block_table) for seq in decode_seqs)
            tables = torch.tensor(
                [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in decode_seqs],
                dtype=torch.long,
            )
            lens = torch.tensor(ctx_lens, dtype=torch.long)
            # The new token's slot; the dense decode_slots / decode_mask only where a backend reads
            # them (DecodeTablesMetadata makes them from the tables and lengths then).
            slot_parts.append(torch.tensor([seq.block_table[(n - 1) // bs] * bs + (n - 1) % bs
                                            for seq, n in zip(decode_seqs, ctx_lens, strict=True)], dtype=torch.long))
            if self._measure_shared_prefix:
                decode_shared_len = shared_prefix_len(tables, ctx_lens, bs)
            sample_rows.extend(range(num_decodes))
            sample_seqs.extend(decode_seqs)

        # Prefill chunks: a run of tokens each, attending to all earlier context.
        prefills: list[PrefillSpan] = []
        for seq, n in scheduled[num_decodes:]:
            start = seq.num_computed_tokens
            end = start + n
            query_start = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            proposal = spec_tokens.get(seq.seq_id) if spec_tokens else None
            if proposal:
                input_ids.extend(proposal)
                n += len(proposal)
                end += len(proposal)
            positions.extend(range(start, end))
            table = torch.tensor(seq.block_table[: (end + bs - 1) // bs], dtype=torch.long)
            context_slots = (table.unsqueeze(-1) * bs + self._block_offsets).view(-1)[:end]
            slot_parts.append(context_slots[start:end])
            prefills.append(PrefillSpan(query_start, n, end, context_slots, table))
            if proposal:
                sample_rows.extend(range(query_start, query_start + n))
                sample_seqs.extend([seq] * n)
            elif end == seq.num_tokens:  # the last chunk of the prompt samples the first token
                sample_rows.append(query_start + n - 1)
                sample_seqs.append(seq)

        metadata = DecodeTablesMetadata(
            slot_mapping=torch.cat(slot_parts) if len(slot_parts) > 1 else slot_parts[0],
            num_decode_tokens=num_decodes,
            decode_slots=None,
            decode_mask=None,
            prefills=prefills,
            decode_shared_len=decode_shared_len,
            block_size=bs,
            decode_block_tables=tables,
            decode_context_lens=lens,
        )
        return StepInput(
            input_ids=torch.tensor(input_ids, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            metadata=metadata,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long),
            sample_seqs=sample_seqs,
        )

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor:
        """Run the model on the step; return float32 logits of the sampling rows [S, vocab]."""
        return self.execute_argmax(step, argmax=False)[0]

    def execute_argmax(self, step: StepInput, argmax: bool = True,
                       logits: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """execute(step), and with `argmax` each sampling row's first maximum of its logits where
        the lm_head's kernel finds it in its epilogue (None otherwise): what greedy rows sample.
        `logits` False (with argmax): the caller samples nothing else, so where the kernel gives
        the ids the logits are [S, 0], never stored; where it does not (ids None) they are whole."""
        if self.decode_graphs is not None:
            with torch.inference_mode():
                logits = self.decode_graphs.run(step.input_ids, step.positions, step.metadata)
            if logits is not None:
                return logits, None
        if self.device.type != "cpu":  # built on the host; the model and its caches are on the device
            step = replace(step, input_ids=step.input_ids.to(self.device), positions=step.positions.to(self.device),
                           metadata=step.metadata.to(self.device), sample_rows=step.sample_rows.to(self.device))
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.metadata)
        if step.sample_rows.numel() == 0:
            return hidden.new_empty((0, 0), dtype=torch.float32), None
        rows = hidden.index_select(0, step.sample_rows)
        if argmax:
            return self.model.compute_logits_argmax(rows, logits)
        out, maxima = self.model.compute_logits_maxima(rows)
        self._maxima = None if maxima is None else (weakref.ref(out), maxima)
        return out, None

    def chunk_maxima(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Each row's maximum of every 16 entries of `logits` [S, vocab] (NaN where one is NaN), as
        the lm_head's kernel found them while it stored these logits (a bf16 InvariantLinear's
        epilogue), or None: other logits, or no such kernel. What a top-k / top-p draw's head pass
        reads instead of the whole logits (Sampler.sample's chunk_maxima). The logits are inference
        tensors, which keep no version counter: their identity vouches, as for the lm_head's argmax
        ids (nothing between the step and its sampler writes into them)."""
        if self._maxima is None:
            return None
        ref, maxima = self._maxima
        return maxima if ref() is logits else None
