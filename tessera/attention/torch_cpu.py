"""Paged attention in plain PyTorch, tuned for CPU.

Decodes run batched: each sequence's context is gathered from the cache straight into a
head-major [B, Hkv, L, d] float32 buffer (one `index_select` with a row index built once per
step), then q grouped as [B, Hkv, g, d] goes through matmul + softmax + matmul. Measured on
the development CPU this beats SDPA with enable_gqa, and gathering head-major beats gathering
slot-major and transposing (one pass over the K/V bytes instead of two). Decode attention stays
in float32 because CPU SDPA/matmul in bf16 at a single query row is very slow.

When every decode of a step reads the same leading blocks (a shared prompt from the prefix
cache), the model runner says how many positions (decode_shared_len) and the decodes go through
tessera.attention.cascade: the shared K/V are gathered once instead of once per sequence.

Prefill spans use SDPA in the model dtype: a fresh prompt attends to its own new K/V with
is_causal (no cache read); a chunk with earlier context gathers its context from the cache and
uses a bottom-right causal mask built once per step.

A layer with a sliding window W (Mistral, Gemma 3's local layers) masks every key more than
W - 1 positions behind its query, as transformers does; the masks are built once per step and
window. Keys behind the window may sit in block 0 (the scheduler frees blocks that fell out of
every layer's window), which is why they must be masked, not just ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tessera.attention.backend import AttentionBackend
from tessera.attention.cascade import cascade_decode_attention
from tessera.attention.metadata import AttentionMetadata
from tessera.quant.kv import is_quantized, write_quantized


@dataclass
class _StepPlan:
    """What every layer of one step shares, derived from the metadata once."""

    metadata: AttentionMetadata
    num_kv_heads: int
    covers_all_tokens: bool
    # Decodes: rows of cache.view(-1, d) in [B, Hkv, L] order, and the additive fp32 mask.
    decode_rows: torch.Tensor | None
    decode_bias: torch.Tensor | None  # [B, 1, 1, L]: 0 = attend, -inf = padding
    decode_shape: tuple[int, int]  # (B, L)
    # Cascade decodes (decode_shared_len P > 0): rows of the shared prefix in [Hkv, P] order,
    # rows and bias of each sequence's own suffix in [B, Hkv, L - P] order.
    decode_prefix_len: int
    decode_prefix_rows: torch.Tensor | None
    decode_suffix_rows: torch.Tensor | None
    decode_suffix_bias: torch.Tensor | None
    # Prefill spans: None for a fresh prompt (attends to its own new K/V, causal), else the
    # head-major rows of its context and its [query_len, context_len] bool mask.
    span_rows: list[torch.Tensor | None]
    span_masks: list[torch.Tensor | None]
    # Sliding windows seen this step: window -> (decode bias, span masks) with the window applied.
    windowed: dict[int, tuple[torch.Tensor | None, list[torch.Tensor | None]]] = field(default_factory=dict)


def _build_plan(metadata: AttentionMetadata, num_kv_heads: int, device: torch.device) -> _StepPlan:
    heads = torch.arange(num_kv_heads, device=device)
    num_decodes = metadata.num_decode_tokens
    decode_rows = decode_bias = None
    decode_shape = (0, 0)
    if num_decodes:
        slots = metadata.decode_slots
        if slots is None or slots.shape[0] != num_decodes:
            raise ValueError(
                f"num_decode_tokens is {num_decodes} but decode_slots is "
                f"{None if slots is None else tuple(slots.shape)}; expected [{num_decodes}, max_context]"
            )
        decode_shape = (int(slots.shape[0]), int(slots.shape[1]))
        decode_rows = (slots.unsqueeze(1) * num_kv_heads + heads.view(1, -1, 1)).reshape(-1)
        if metadata.decode_mask is not None:
            mask = metadata.decode_mask.reshape(decode_shape[0], 1, 1, decode_shape[1])
            decode_bias = torch.zeros(mask.shape, dtype=torch.float32, device=device)
            decode_bias.masked_fill_(~mask, float("-inf"))
    prefix_len = metadata.decode_shared_len if num_decodes else 0
    prefix_rows = suffix_rows = suffix_bias = None
    if prefix_len:
        slots = metadata.decode_slots
        prefix_rows = (heads.view(-1, 1) + slots[0, :prefix_len].view(1, -1) * num_kv_heads).reshape(-1)
        suffix_rows = (slots[:, prefix_len:].unsqueeze(1) * num_kv_heads + heads.view(1, -1, 1)).reshape(-1)
        suffix_bias = decode_bias[..., prefix_len:].contiguous() if decode_bias is not None else None
    span_rows: list[torch.Tensor | None] = []
    span_masks: list[torch.Tensor | None] = []
    covered = num_decodes
    for span in metadata.prefills:
        covered += span.query_len
        if span.context_len == span.query_len:
            span_rows.append(None)
            span_masks.append(None)
            continue
        slots = span.context_slots[: span.context_len]
        span_rows.append((heads.view(-1, 1) + slots.view(1, -1) * num_kv_heads).reshape(-1))
        offset = span.context_len - span.query_len
        query_pos = torch.arange(span.query_len, device=device).view(-1, 1) + offset
        span_masks.append(torch.arange(span.context_len, device=device).view(1, -1) <= query_pos)
    return _StepPlan(
        metadata=metadata,
        num_kv_heads=num_kv_heads,
        covers_all_tokens=covered == metadata.num_tokens,
        decode_rows=decode_rows,
        decode_bias=decode_bias,
        decode_shape=decode_shape,
        decode_prefix_len=prefix_len,
        decode_prefix_rows=prefix_rows,
        decode_suffix_rows=suffix_rows,
        decode_suffix_bias=suffix_bias,
        span_rows=span_rows,
        span_masks=span_masks,
    )


def _window_masks(plan: _StepPlan, window: int, device: torch.device) -> tuple[torch.Tensor | None, list]:
    """The step's decode bias and span masks with keys further than window - 1 positions behind
    each query masked out (transformers: kv_idx > q_idx - window)."""
    metadata = plan.metadata
    decode_bias = None
    if metadata.num_decode_tokens:
        batch, max_context = plan.decode_shape
        if metadata.decode_mask is not None:
            lens = metadata.decode_mask.reshape(batch, max_context).sum(-1, keepdim=True)
        else:
            lens = torch.full((batch, 1), max_context, device=device)
        keep = torch.arange(max_context, device=device).view(1, -1) > lens - 1 - window
        decode_bias = torch.zeros(batch, 1, 1, max_context, dtype=torch.float32, device=device)
        decode_bias.masked_fill_(~keep.view(batch, 1, 1, max_context), float("-inf"))
        if plan.decode_bias is not None:
            decode_bias.add_(plan.decode_bias)
    span_masks: list[torch.Tensor | None] = []
    for span in metadata.prefills:
        offset = span.context_len - span.query_len
        if offset == 0 and span.query_len <= window:
            span_masks.append(None)  # plain causal attention already stays inside the window
            continue
        query_pos = torch.arange(span.query_len, device=device).view(-1, 1) + offset
        key_pos = torch.arange(span.context_len, device=device).view(1, -1)
        span_masks.append((key_pos <= query_pos) & (key_pos > query_pos - window))
    return decode_bias, span_masks


class TorchCPUAttention(AttentionBackend):
    """The reference backend: PyTorch ops only, fastest on CPU, also correct on CUDA."""

    name = "torch"
    supports_quantized_kv = True

    def reads_shared_prefix(self, head_dim: int) -> bool:
        return True

    def __init__(self) -> None:
        self._plan: _StepPlan | None = None
        # Grow-only scratch buffers reused by every layer and step: a fresh multi-MB tensor per
        # layer would be page-faulted in each time.
        self._workspace: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def begin_step(self, metadata: AttentionMetadata) -> None:
        self._plan = None  # rebuilt lazily by the first layer, which knows num_kv_heads

    def release_workspace(self) -> None:
        """Free the scratch buffers (they are as large as one layer's gathered K and V)."""
        self._workspace.clear()

    def _plan_for(self, metadata: AttentionMetadata, num_kv_heads: int, device: torch.device) -> _StepPlan:
        plan = self._plan
        if plan is None or plan.metadata is not metadata or plan.num_kv_heads != num_kv_heads:
            plan = self._plan = _build_plan(metadata, num_kv_heads, device)
        return plan

    def _buffer(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._workspace.get((name, dtype))
        if buf is None or buf.numel() < numel or buf.device != device:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._workspace[(name, dtype)] = buf
        return buf[:numel]

    def _gather(
        self, cache: torch.Tensor, rows: torch.Tensor, shape: tuple[int, ...], name: str, dtype: torch.dtype
    ) -> torch.Tensor:
        """cache.view(-1, d)[rows] as a contiguous tensor of `shape` in `dtype`, in scratch memory."""
        head_dim = cache.shape[-1]
        numel = rows.numel() * head_dim
        raw = self._buffer(name, numel, cache.dtype, cache.device)
        torch.index_select(cache.view(-1, head_dim), 0, rows, out=raw.view(-1, head_dim))
        if cache.dtype == dtype:
            return raw.view(shape)
        converted = self._buffer(name, numel, dtype, cache.device)
        converted.copy_(raw)
        return converted.view(shape)

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
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        # A quantized cache (--kv-cache-dtype int8/fp8) also holds scales per (token, KV head);
        # everything attends to the dequantized values, a fresh prompt's own K/V included.
        k_scales, v_scales = (kv_cache[2], kv_cache[3]) if is_quantized(kv_cache) else (None, None)
        if k_scales is None:
            k_cache.index_copy_(0, metadata.slot_mapping, k.to(k_cache.dtype))
            v_cache.index_copy_(0, metadata.slot_mapping, v.to(v_cache.dtype))
        else:
            k, v = write_quantized(kv_cache, k, v, metadata.slot_mapping, q.dtype)
        plan = self._plan_for(metadata, num_kv_heads, q.device)
        decode_bias, span_masks = plan.decode_bias, plan.span_masks
        if sliding_window is not None:
            if sliding_window not in plan.windowed:
                plan.windowed[sliding_window] = _window_masks(plan, sliding_window, q.device)
            decode_bias, span_masks = plan.windowed[sliding_window]

        pieces: list[tuple[int, torch.Tensor]] = []  # (first token, [n, H*d] output)
        num_decodes = metadata.num_decode_tokens
        if num_decodes:
            pieces.append((0, self._decode(q[:num_decodes], k_cache, v_cache, plan, scale, k_scales, v_scales,
                                           decode_bias, windowed=sliding_window is not None)))
        for span, rows, mask in zip(metadata.prefills, plan.span_rows, span_masks, strict=True):
            end = span.query_start + span.query_len
            qs = q[span.query_start : end].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
            if rows is None:  # a fresh prompt: its own K/V (masked too when longer than a window)
                ks = k[span.query_start : end].transpose(0, 1).unsqueeze(0)
                vs = v[span.query_start : end].transpose(0, 1).unsqueeze(0)
                ks, vs = ks.to(q.dtype), vs.to(q.dtype)
            else:
                shape = (1, num_kv_heads, span.context_len, head_dim)
                ks = self._gather(k_cache, rows, shape, "k", q.dtype)
                vs = self._gather(v_cache, rows, shape, "v", q.dtype)
                if k_scales is not None:
                    ks.mul_(self._gather_scales(k_scales, rows, shape, "ks", q.dtype))
                    vs.mul_(self._gather_scales(v_scales, rows, shape, "vs", q.dtype))
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale,
                enable_gqa=num_kv_heads != num_heads,
            )
            pieces.append((span.query_start, o[0].transpose(0, 1).reshape(span.query_len, num_heads * head_dim)))

        if len(pieces) == 1 and plan.covers_all_tokens:
            return pieces[0][1].to(q.dtype)
        alloc = torch.empty if plan.covers_all_tokens else torch.zeros
        out = alloc(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
        for start, piece in pieces:
            out[start : start + piece.shape[0]] = piece
        return out

    def _gather_scales(self, scales: torch.Tensor, rows: torch.Tensor, shape: tuple[int, ...], name: str,
                       dtype: torch.dtype) -> torch.Tensor:
        """The per-(token, head) scales of a quantized cache at `rows`, as [*shape[:-1], 1]."""
        return self._gather(scales, rows, (*shape[:-1], 1), name, dtype)

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _StepPlan, scale: float,
        k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
        decode_bias: torch.Tensor | None = None, windowed: bool = False,
    ) -> torch.Tensor:
        """Batched decode attention in float32: q [B, H, d] -> [B, H*d].

        With a quantized cache the codes are converted to float and the scales applied where it
        is cheapest: a key's scale to its score column (q . (s k) = s (q . k)), a value's to its
        probability (sum p_l s_l v_l), i.e. g * L multiplies per head instead of L * d."""
        if plan.decode_prefix_len and k_scales is None and not windowed:
            return self._cascade_decode(q, k_cache, v_cache, plan, scale)
        batch, max_context = plan.decode_shape
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = plan.num_kv_heads
        shape = (batch, num_kv_heads, max_context, head_dim)
        keys = self._gather(k_cache, plan.decode_rows, shape, "k", torch.float32)
        values = self._gather(v_cache, plan.decode_rows, shape, "v", torch.float32)
        grouped_q = (q.float() * scale).reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = torch.matmul(grouped_q, keys.transpose(-1, -2))  # [B, Hkv, g, L]
        if k_scales is not None:
            scores.mul_(self._gather(k_scales, plan.decode_rows, shape[:3], "ks", torch.float32).unsqueeze(2))
        if decode_bias is not None:
            scores.add_(decode_bias)
        probs = torch.softmax(scores, dim=-1)
        if v_scales is not None:
            probs.mul_(self._gather(v_scales, plan.decode_rows, shape[:3], "vs", torch.float32).unsqueeze(2))
        return torch.matmul(probs, values).view(batch, num_heads * head_dim)

    def _cascade_decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _StepPlan, scale: float
    ) -> torch.Tensor:
        """Decode attention with the shared prefix gathered once (tessera.attention.cascade)."""
        batch, max_context = plan.decode_shape
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = plan.num_kv_heads
        prefix_len = plan.decode_prefix_len
        prefix_shape = (num_kv_heads, prefix_len, head_dim)
        suffix_shape = (batch, num_kv_heads, max_context - prefix_len, head_dim)
        prefix_k = self._gather(k_cache, plan.decode_prefix_rows, prefix_shape, "pk", torch.float32)
        prefix_v = self._gather(v_cache, plan.decode_prefix_rows, prefix_shape, "pv", torch.float32)
        suffix_k = self._gather(k_cache, plan.decode_suffix_rows, suffix_shape, "k", torch.float32)
        suffix_v = self._gather(v_cache, plan.decode_suffix_rows, suffix_shape, "v", torch.float32)
        grouped_q = (q.float() * scale).reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = cascade_decode_attention(grouped_q, prefix_k, prefix_v, suffix_k, suffix_v, plan.decode_suffix_bias)
        return out.reshape(batch, num_heads * head_dim)
