"""The Triton attention backend: paged attention kernels for NVIDIA GPUs.

Per layer and step: one kernel writes the step's new K/V into the cache by slot mapping; decodes
run a split-K kernel (each sequence's context cut into `num_splits` pieces so that short batches
with long contexts still fill the GPU) and a small kernel that merges the pieces by their
log-sum-exp; all prefill spans of the step (fresh prompts and later chunks alike) run in one
launch of the prefill kernel, which reads the whole context, new tokens included, back from the
cache. Kernels live in `tessera.attention.triton_kernels`.

Decode context lengths come from `decode_mask` (the number of True entries per row): this
backend requires each row's mask to be a prefix (positions 0 .. len-1), which is how the model
runner builds it. What every layer of a step shares is derived once per step, with no host
synchronisation on the decode path, so a decode step can be captured in a CUDA graph.

Without a GPU the kernels run on CPU tensors under TRITON_INTERPRET=1 (slow; for tests only).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from tessera.attention.backend import AttentionBackend
from tessera.attention.metadata import AttentionMetadata

try:
    from triton.runtime.interpreter import InterpretedFunction

    from tessera.attention import triton_kernels as kernels
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "the triton attention backend needs the triton package: pip install 'tessera[gpu]' "
        "(or use the torch attention backend)"
    ) from exc

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class TritonAttentionConfig:
    """Tile sizes and launch settings; the defaults are starting points for Hopper-class GPUs
    (benchmarks/gpu/bench_attention.py sweeps a few of each)."""

    decode_block_n: int = 64  # context positions per inner-loop tile
    decode_num_warps: int = 4
    decode_num_stages: int = 3  # H200, benchmarks/gpu/RESULTS.md: 96% of copy bandwidth against 77% at 2, same bits
    num_splits: int | None = None  # None: chosen per step to fill the GPU
    programs_per_sm: int = 4  # split heuristic: aim for this many decode programs per SM
    min_tokens_per_split: int = 256  # never cut a context finer than this
    prefill_block_m: int = 64  # query rows (token x query head of the group) per program
    prefill_block_n: int = 64
    prefill_num_warps: int = 4
    prefill_num_stages: int = 2


@dataclass
class _StepPlan:
    """What every layer of one step shares, derived from the metadata once."""

    metadata: AttentionMetadata
    num_heads: int
    num_kv_heads: int
    covers_all_tokens: bool
    slot_mapping: torch.Tensor  # [T] long, on the device (the runner may build it on the host)
    # Decodes.
    decode_slots: torch.Tensor | None  # [B, max_context] long, contiguous
    decode_lens: torch.Tensor | None  # [B] int32
    num_splits: int
    tokens_per_split: int
    # Prefill spans: per span [query_start, query_len, context_len, slots_start] rows, per tile
    # (span, first token); context slots of all spans concatenated.
    span_table: torch.Tensor | None  # [4, num_spans] int32
    tile_table: torch.Tensor | None  # [2, num_tiles] int32
    context_slots: torch.Tensor | None  # [sum of context_len] long
    block_q: int


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def decode_block_g(group: int) -> int:
    """Rows of the decode kernel's query tile: the GQA group, padded for tl.dot (>= 16)."""
    return max(16, _next_pow2(group))


def prefill_block_q(group: int, block_m: int) -> int:
    """New tokens per prefill tile, so that tokens x padded group is block_m rows (>= 16)."""
    block_g = _next_pow2(group)
    return max(block_m // block_g, -(-16 // block_g), 1)


@cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_splits(batch: int, num_kv_heads: int, max_context: int, config: TritonAttentionConfig,
                  device: torch.device) -> tuple[int, int]:
    """(num_splits, tokens_per_split) for a decode batch: enough programs to fill the GPU, no
    piece shorter than min_tokens_per_split, every piece a whole number of tiles."""
    block_n = config.decode_block_n
    if config.num_splits is not None:
        wanted = config.num_splits
    elif device.type == "cuda":
        target = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
        wanted = -(-target * config.programs_per_sm // max(1, batch * num_kv_heads))
        wanted = min(wanted, max(1, max_context // config.min_tokens_per_split))
    else:
        wanted = 1
    wanted = max(1, min(wanted, -(-max_context // block_n)))
    tokens_per_split = -(-max_context // wanted)
    tokens_per_split = -(-tokens_per_split // block_n) * block_n
    return -(-max_context // tokens_per_split), tokens_per_split


def _build_plan(metadata: AttentionMetadata, num_heads: int, num_kv_heads: int, device: torch.device,
                config: TritonAttentionConfig) -> _StepPlan:
    num_decodes = metadata.num_decode_tokens
    decode_slots = decode_lens = None
    num_splits, tokens_per_split = 1, config.decode_block_n
    if num_decodes:
        slots = metadata.decode_slots
        if slots is None or slots.shape[0] != num_decodes:
            raise ValueError(
                f"num_decode_tokens is {num_decodes} but decode_slots is "
                f"{None if slots is None else tuple(slots.shape)}; expected [{num_decodes}, max_context]"
            )
        decode_slots = slots.to(device=device, dtype=torch.long).contiguous()
        max_context = int(slots.shape[1])
        if metadata.decode_context_lens is not None:  # a no-op on a CUDA graph's own int32 buffer
            decode_lens = metadata.decode_context_lens.to(device=device, dtype=torch.int32)
        elif metadata.decode_mask is None:
            decode_lens = torch.full((num_decodes,), max_context, dtype=torch.int32, device=device)
        else:
            mask = metadata.decode_mask.to(device).reshape(num_decodes, max_context)
            decode_lens = mask.sum(dim=1, dtype=torch.int32)
        num_splits, tokens_per_split = choose_splits(num_decodes, num_kv_heads, max_context, config, device)

    group = num_heads // num_kv_heads
    block_q = prefill_block_q(group, config.prefill_block_m)
    span_table = tile_table = context_slots = None
    covered = num_decodes
    if metadata.prefills:
        spans: list[list[int]] = [[], [], [], []]
        tiles: list[tuple[int, int, int]] = []  # (kv positions to read, span, first token)
        slots_start = 0
        for i, span in enumerate(metadata.prefills):
            covered += span.query_len
            for col, value in enumerate((span.query_start, span.query_len, span.context_len, slots_start)):
                spans[col].append(value)
            slots_start += span.context_len
            offset = span.context_len - span.query_len
            for first in range(0, span.query_len, block_q):
                tiles.append((min(offset + first + block_q, span.context_len), i, first))
        # Longest tiles first, so the short ones fill the gaps at the end of the grid.
        tiles.sort(key=lambda t: -t[0])
        packed = torch.tensor(
            [v for col in spans for v in col] + [t[1] for t in tiles] + [t[2] for t in tiles], dtype=torch.int32
        ).to(device)
        num_spans = len(metadata.prefills)
        span_table = packed[: 4 * num_spans].view(4, num_spans)
        tile_table = packed[4 * num_spans :].view(2, len(tiles))
        pieces = [span.context_slots[: span.context_len] for span in metadata.prefills]
        context_slots = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).to(device=device, dtype=torch.long)
    return _StepPlan(
        metadata=metadata,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        covers_all_tokens=covered == metadata.num_tokens,
        slot_mapping=metadata.slot_mapping.to(device=device, dtype=torch.long),
        decode_slots=decode_slots,
        decode_lens=decode_lens,
        num_splits=num_splits,
        tokens_per_split=tokens_per_split,
        span_table=span_table,
        tile_table=tile_table,
        context_slots=context_slots,
        block_q=block_q,
    )


def kernels_interpreted() -> bool:
    """True when the kernels were built for the Triton interpreter (TRITON_INTERPRET=1)."""
    return isinstance(kernels.write_kv_cache_kernel, InterpretedFunction)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class TritonAttention(AttentionBackend):
    """Paged attention with Triton kernels; CUDA tensors (or CPU ones under TRITON_INTERPRET=1)."""

    name = "triton"

    def __init__(self, config: TritonAttentionConfig | None = None) -> None:
        self.config = config or TritonAttentionConfig()
        self._plan: _StepPlan | None = None

    def begin_step(self, metadata: AttentionMetadata) -> None:
        self._plan = None  # rebuilt by the first layer, which knows the head counts

    def _plan_for(self, metadata: AttentionMetadata, num_heads: int, num_kv_heads: int,
                  device: torch.device) -> _StepPlan:
        plan = self._plan
        if (plan is None or plan.metadata is not metadata or plan.num_heads != num_heads
                or plan.num_kv_heads != num_kv_heads):
            plan = self._plan = _build_plan(metadata, num_heads, num_kv_heads, device, self.config)
        return plan

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        if sliding_window is not None:
            raise NotImplementedError("sliding-window attention is implemented in the torch attention backend "
                                      "only: use --attention-backend torch for this model")
        k_cache, v_cache = kv_cache
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        if q.device.type != "cuda" and not kernels_interpreted():
            raise RuntimeError(
                f"the triton attention backend needs CUDA tensors, got {q.device}: use "
                "the torch attention backend on CPU (or set TRITON_INTERPRET=1 before triton is first "
                "imported to run the kernels in the slow interpreter, as the tests do)"
            )
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not split into groups over {num_kv_heads} KV heads")
        if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
            raise ValueError("k_cache and v_cache must have the same strides and a contiguous last dim")
        q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
        cfg = self.config
        block_d = _next_pow2(head_dim)

        plan = self._plan_for(metadata, num_heads, num_kv_heads, q.device)
        if num_tokens:
            kernels.write_kv_cache_kernel[(num_tokens,)](
                k, v, k_cache, v_cache, plan.slot_mapping,
                k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
                NUM_KV_HEADS=num_kv_heads, BLOCK_H=_next_pow2(num_kv_heads), HEAD_DIM=head_dim, BLOCK_D=block_d,
            )
        alloc = torch.empty if plan.covers_all_tokens else torch.zeros
        out = alloc(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
        group = num_heads // num_kv_heads
        qk_scale = scale * LOG2E
        precision = "ieee" if k_cache.dtype == torch.float32 else "tf32"

        num_decodes = metadata.num_decode_tokens
        if num_decodes:
            splits = plan.num_splits
            part_out = torch.empty(num_decodes, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
            part_lse = torch.empty(num_decodes, num_heads, splits, dtype=torch.float32, device=q.device)
            kernels.paged_decode_split_kernel[(num_decodes, num_kv_heads, splits)](
                q, k_cache, v_cache, plan.decode_slots, plan.decode_lens, part_out, part_lse,
                qk_scale, plan.tokens_per_split,
                q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), plan.decode_slots.stride(0),
                GROUP=group, BLOCK_G=decode_block_g(group), HEAD_DIM=head_dim, BLOCK_D=block_d,
                BLOCK_N=cfg.decode_block_n, DOT_PRECISION=precision,
                num_warps=cfg.decode_num_warps, num_stages=cfg.decode_num_stages,
            )
            kernels.reduce_splits_kernel[(num_decodes, num_heads)](
                part_out, part_lse, out, splits, out.stride(0),
                HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=_next_pow2(splits),
            )
        if plan.tile_table is not None:
            spans, tiles = plan.span_table, plan.tile_table
            kernels.paged_prefill_kernel[(tiles.shape[1], num_kv_heads)](
                q, k_cache, v_cache, out, plan.context_slots,
                tiles[0], tiles[1], spans[0], spans[1], spans[2], spans[3],
                qk_scale, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0),
                GROUP=group, BLOCK_G=_next_pow2(group), BLOCK_Q=plan.block_q, HEAD_DIM=head_dim, BLOCK_D=block_d,
                BLOCK_N=cfg.prefill_block_n, DOT_PRECISION=precision,
                num_warps=cfg.prefill_num_warps, num_stages=cfg.prefill_num_stages,
            )
        return out




COMPILE_VARIANTS = (("fp32", 3, 64), ("fp16", 8, 64), ("bf16", 4, 128), ("bf16", 1, 128))


def compile_for_target(arch: int = 90, variants=COMPILE_VARIANTS, verbose: bool = True) -> list[tuple[str, int]]:
    """Compile the kernels ahead of time for an NVIDIA target (sm_`arch`) with no GPU present,
    for each (cache dtype, GQA group, head_dim) in `variants` with the default tile sizes.
    Returns (variant, shared memory bytes); raises on any compile error. Needs kernels built for
    the GPU, i.e. a process where TRITON_INTERPRET was not set when triton was imported."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    if kernels_interpreted():
        raise RuntimeError("compile_for_target needs a process without TRITON_INTERPRET=1")
    target = GPUTarget("cuda", arch, 32)
    cfg = TritonAttentionConfig()
    i32, f32 = "i32", "fp32"
    results = []

    def build(kernel, pointers: dict[str, str], scalars: list[str], constexprs: dict, options: dict, label: str):
        signature = {name: kind for name, kind in pointers.items()}
        signature.update({name: (f32 if name == "qk_scale" else i32) for name in scalars})
        signature.update({name: "constexpr" for name in constexprs})
        names = kernel.arg_names
        signature = {name: signature[name] for name in names}
        compiled = compile(ASTSource(kernel, signature, constexprs), target=target, options=options)
        shared = int(compiled.metadata.shared)
        if shared > 227 * 1024:
            raise RuntimeError(f"{label} needs {shared} bytes of shared memory, over the 227 KiB of sm_90")
        results.append((label, shared))
        if verbose:
            print(f"compiled {label}: {shared} B shared", flush=True)

    for dtype, group, head_dim in variants:
        cache = f"*{dtype}"
        precision = "ieee" if dtype == "fp32" else "tf32"
        block_d = _next_pow2(head_dim)
        tag = f"{dtype} group {group} head_dim {head_dim}"
        build(kernels.write_kv_cache_kernel,
              dict(k_ptr=cache, v_ptr=cache, k_cache_ptr=cache, v_cache_ptr=cache, slot_mapping_ptr="*i64"),
              ["stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_cache_slot", "stride_cache_head"],
              dict(NUM_KV_HEADS=8, BLOCK_H=8, HEAD_DIM=head_dim, BLOCK_D=block_d), {}, f"write_kv_cache {tag}")
        build(kernels.paged_decode_split_kernel,
              dict(q_ptr=cache, k_cache_ptr=cache, v_cache_ptr=cache, slots_ptr="*i64", context_lens_ptr="*i32",
                   part_out_ptr="*fp32", part_lse_ptr="*fp32"),
              ["qk_scale", "tokens_per_split", "stride_qb", "stride_qh", "stride_cache_slot", "stride_cache_head",
               "stride_slots_b"],
              dict(GROUP=group, BLOCK_G=decode_block_g(group), HEAD_DIM=head_dim, BLOCK_D=block_d,
                   BLOCK_N=cfg.decode_block_n, DOT_PRECISION=precision),
              dict(num_warps=cfg.decode_num_warps, num_stages=cfg.decode_num_stages), f"paged_decode_split {tag}")
        build(kernels.reduce_splits_kernel,
              dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr=cache), ["num_splits", "stride_out_b"],
              dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=8), {}, f"reduce_splits {tag}")
        build(kernels.paged_prefill_kernel,
              dict(q_ptr=cache, k_cache_ptr=cache, v_cache_ptr=cache, out_ptr=cache, context_slots_ptr="*i64",
                   tile_span_ptr="*i32", tile_first_ptr="*i32", span_query_start_ptr="*i32",
                   span_query_len_ptr="*i32", span_context_len_ptr="*i32", span_slots_start_ptr="*i32"),
              ["qk_scale", "stride_qt", "stride_qh", "stride_cache_slot", "stride_cache_head", "stride_out_t"],
              dict(GROUP=group, BLOCK_G=_next_pow2(group), BLOCK_Q=prefill_block_q(group, cfg.prefill_block_m),
                   HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=cfg.prefill_block_n, DOT_PRECISION=precision),
              dict(num_warps=cfg.prefill_num_warps, num_stages=cfg.prefill_num_stages), f"paged_prefill {tag}")
    return results
