"""Gemma 3's decoder stack as one native call per step (tessera/kernels/csrc/gemma_stack.cpp), as
native_stack.py is llama's: the same ops in the same order as the modules of gemma3.py, so the same
bits (the tests compare the two), without their ~40 Python-level calls into torch a layer.

`GemmaStack.build(model)` checks once that every layer is Gemma3DecoderLayer on the native norms,
the invariant CPU attention and linears the stack knows (native_stack._linear_spec), and holds the
per-layer tensors; `forward` runs a step, or returns None where the step needs what the kernel does
not do (a quantized KV cache, no paged block size) and the modules run. `--enforce-eager` keeps the
module path.
"""

from __future__ import annotations

import logging

import torch

from tessera import kernels
from tessera.attention.invariant_cpu import _HEAD_DIMS, InvariantCPUAttention
from tessera.attention.metadata import AttentionMetadata
from tessera.model.native_stack import _linear_spec, layer_linears, takes_step

logger = logging.getLogger("tessera")

_NORMS = ("input_layernorm", "self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm",
          "pre_feedforward_layernorm", "post_feedforward_layernorm")


class GemmaStack:
    def __init__(self, model) -> None:
        cfg = model.config
        self.model = model
        self.dtype = model.dtype
        self.norms = [layer.get_submodule(name) for layer in model.layers for name in _NORMS]
        self.lin_tensors: list[torch.Tensor | None] = []
        self.lin_meta: list[int] = []
        for layer in model.layers:
            meta, tensors = layer_linears(layer)
            self.lin_meta += meta
            self.lin_tensors += tensors
        self.windows = [layer.self_attn.sliding_window or 0 for layer in model.layers]
        self.local = [int(layer.is_local) for layer in model.layers]
        self.eps = model.norm.eps
        self.scale = model.layers[0].self_attn.scale
        self.dims = [cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size]

    @classmethod
    def build(cls, model) -> GemmaStack | None:
        """The stack for `model`, or None (the reason logged at debug) where a layer is not on it."""
        reason = _unsupported(model)
        if reason:
            logger.debug("Gemma decoder stack stays on the module path: %s", reason)
            return None
        return cls(model)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                metadata: AttentionMetadata) -> torch.Tensor | None:
        """The final normed hidden states [T, hidden], or None: run the module path."""
        if not takes_step(self.dtype, hidden, positions, kv_caches, metadata):
            return None
        model = self.model
        # The model's forward has grown both fp32 rotary tables past the longest position (`at`).
        rope_global, rope_local = model.rotary_global, model.rotary_local
        plan = model.attn_backend.kernel_plan(metadata)
        kv = [t for pair in kv_caches for t in pair]
        # The norms' 1 + weight, made again only when a weight changes (GemmaRMSNorm.scale).
        return kernels.ops().gemma_stack(
            hidden, [n.scale() for n in self.norms], self.lin_tensors, self.lin_meta, kv, model.norm.scale(),
            rope_global._cos, rope_global._sin, rope_local._cos, rope_local._sin, positions.contiguous(),
            metadata.slot_mapping, plan.block_tables, plan.token_row, plan.token_ctx,
            self.dims, self.windows, self.local, metadata.block_size, self.scale, self.eps)


def _unsupported(model) -> str | None:
    """Why `model` cannot run on the Gemma stack (None: it can)."""
    from tessera.kernels.linear import InvariantLinear
    from tessera.model.gemma3 import Gemma3Attention, Gemma3DecoderLayer, Gemma3ForCausalLM
    from tessera.model.layers import GeGLUMLP, GemmaRMSNorm

    if type(model) is not Gemma3ForCausalLM:
        return f"{type(model).__name__} is not Gemma3ForCausalLM"
    if model.dtype not in (torch.bfloat16, torch.float32) or not kernels.available():
        return "no native kernels for this dtype"
    if not (kernels.fused(torch.empty(0, dtype=model.dtype)) and kernels.cpu_has_avx512_bf16()):
        return "the native Gemma norm needs AVX-512 BF16"
    if type(model.attn_backend) is not InvariantCPUAttention or model.config.head_dim not in _HEAD_DIMS:
        return "the attention backend is not the invariant CPU kernel"
    if type(model.norm) is not GemmaRMSNorm or not model.layers:
        return "no Gemma final norm"
    eps = model.norm.eps
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        if type(layer) is not Gemma3DecoderLayer or type(attn) is not Gemma3Attention or type(layer.mlp) is not GeGLUMLP:
            return f"layer {i} is not the Gemma 3 layer"
        if any(type(n := layer.get_submodule(name)) is not GemmaRMSNorm or n.eps != eps for name in _NORMS):
            return f"layer {i} has another norm or eps"
        for w in (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            if _linear_spec(w)[0] < 0 or (type(w) is InvariantLinear and w.dtype != model.dtype):
                return f"layer {i} has a weight off the batch-invariant kernels ({type(w).__name__})"
        if attn.backend is not model.attn_backend or attn.scale != model.layers[0].self_attn.scale:
            return f"layer {i} has its own attention backend or scale"
    return None
