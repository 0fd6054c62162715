"""The decoder stack of a llama-family model as one native call per step (the CPU default).

`NativeStack.build(model)` checks, once, that every layer is the plain Llama layer (fused qkv,
optional qkv bias, no q/k norm, SwiGLU MLP, RMSNorm) on the batch-invariant CPU kernels (float
weights as InvariantLinear, quantized ones on their batch-invariant kernel: int8, int4 and
the GGUF modes' Q4_0/Q4_1/Q8_0/K-quant layers, and where there is no AMX the GGUF
Q4_0/Q4_1/Q8_0 int8-activation kernels; the invariant paged attention backend; the fused
elementwise ops), and then holds the per-layer tensors in the order `tessera_inv::decoder_stack`
(tessera/kernels/csrc/decoder_stack.cpp) takes them. `forward` runs a step through it, or
returns None where a step needs what the kernel does not do (a quantized KV cache, no paged
block size), and the module path runs as before.

Why: the module path costs about 25 Python-level calls into torch per layer; one call for the
whole stack removes them and changes no result (the same kernels, arguments and order: the
tests compare the two bit for bit). `--enforce-eager` keeps the module path.
"""

from __future__ import annotations

import logging

import torch

from tessera import kernels
from tessera.attention.invariant_cpu import _HEAD_DIMS, InvariantCPUAttention
from tessera.attention.metadata import AttentionMetadata

logger = logging.getLogger("tessera")

# Tensor slots per linear in the stacks' lin_tensors (stack_common.h's kLinearSlots): the most any
# kind takes (kind 4: packed, codes, planes, sup, sub), the unused ones None.
LINEAR_SLOTS = 5


class NativeStack:
    def __init__(self, model, norms: list[torch.Tensor], lin_tensors: list[torch.Tensor | None], lin_meta: list[int],
                 biases: list[torch.Tensor | None], windows: list[int], eps: float, scale: float) -> None:
        cfg = model.config
        self.model = model
        self.dtype = model.dtype
        self.norms = norms
        self.lin_tensors = lin_tensors
        self.lin_meta = lin_meta
        self.biases = biases
        self.windows = windows
        self.eps = eps
        self.scale = scale
        self.dims = [cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size]

    @classmethod
    def build(cls, model) -> NativeStack | None:
        """The stack for `model`, or None (with the reason logged at debug) where any layer is not
        the plain shape on the invariant kernels."""
        reason = _unsupported(model)
        if reason:
            logger.debug("decoder stack stays on the module path: %s", reason)
            return None
        norms: list[torch.Tensor] = []
        lin_tensors: list[torch.Tensor | None] = []
        lin_meta: list[int] = []
        biases: list[torch.Tensor | None] = []
        windows: list[int] = []
        for layer in model.layers:
            attn = layer.self_attn
            norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            meta, tensors = layer_linears(layer)
            lin_meta += meta
            lin_tensors += tensors
            biases.append(attn.qkv_bias)
            windows.append(attn.sliding_window or 0)
        first = model.layers[0]
        return cls(model, norms, lin_tensors, lin_meta, biases, windows, first.input_layernorm.eps,
                   first.self_attn.scale)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                metadata: AttentionMetadata) -> torch.Tensor | None:
        """The final normed hidden states [T, hidden], or None: run the module path."""
        if not takes_step(self.dtype, hidden, positions, kv_caches, metadata):
            return None
        rotary = self.model.rotary
        rotary.at(positions, self.dtype)  # grows the fp32 tables past the longest position
        plan = self.model.attn_backend.kernel_plan(metadata)
        kv = [t for pair in kv_caches for t in pair]
        return kernels.ops().decoder_stack(
            hidden, self.norms, self.lin_tensors, self.lin_meta, self.biases, kv, self.model.norm.weight,
            rotary._cos, rotary._sin, positions.contiguous(), metadata.slot_mapping,
            plan.block_tables, plan.token_row, plan.token_ctx,
            self.dims, self.windows, metadata.block_size, self.scale, self.eps)


def takes_step(dtype: torch.dtype, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list,
               metadata: AttentionMetadata) -> bool:
    """Whether a native stack of `dtype` runs this step: paged, contiguous hidden states of its dtype,
    long positions and K/V caches of its dtype (a quantized KV cache takes the module path)."""
    return (metadata.block_size is not None and hidden.dtype == dtype and hidden.is_contiguous()
            and positions.dtype == torch.long and all(len(kv) == 2 and kv[0].dtype == dtype for kv in kv_caches))


def build_native_stack(model):
    """The native stack for `model`: Gemma 3's (gemma_stack.py) or a llama-family one, or None."""
    from tessera.model.gemma3 import Gemma3ForCausalLM

    if isinstance(model, Gemma3ForCausalLM):
        from tessera.model.gemma_stack import GemmaStack

        return GemmaStack.build(model)
    return NativeStack.build(model)


def layer_linears(layer) -> tuple[list[int], list[torch.Tensor | None]]:
    """A layer's four linears (qkv, o, gate_up, down) as both stacks take them: (kind, format) each
    in the first list, LINEAR_SLOTS tensor slots each (the unused ones None) in the second."""
    meta: list[int] = []
    slots: list[torch.Tensor | None] = []
    attn, mlp = layer.self_attn, layer.mlp
    for w in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        kind, fmt, tensors = _linear_spec(w)
        meta += [kind, fmt]
        slots += tensors + [None] * (LINEAR_SLOTS - len(tensors))
    return meta, slots


def _linear_spec(w) -> tuple[int, int, list[torch.Tensor | None]]:
    """(kind, format, tensors) of a linear as decoder_stack.cpp takes it (its header lists the
    kinds), or kind -1: no batch-invariant kernel the stack knows."""
    from tessera.kernels.linear import InvariantLinear
    from tessera.quant import invariant
    from tessera.quant.gguf_int8_activations import Q4BlocksLinear, Q8BlocksLinear
    from tessera.quant.gguf_kquant import GGUFBlockLinear
    from tessera.quant.gguf_native import Q8_0Linear
    from tessera.quant.gguf_tiles import KIND
    from tessera.quant.int4 import Int4Linear
    from tessera.quant.int8 import Int8Linear

    kind = type(w)
    if kind is InvariantLinear:
        if w.codes is not None:  # decode sizes from the GGUF blocks (tessera/quant/gguf_codes.py)
            return 4, w.codes_kind + 256 * w.codes_max_rows, [w.packed, w.codes.codes, w.codes.planes, w.codes.sup,
                                                              w.codes.sub]
        if w.dtype == torch.bfloat16:
            return 0, 0, [w.packed]
        if w.f32_blocks is not None:  # decode sizes from the GGUF blocks (tessera/quant/gguf_f32_blocks.py)
            return 7, int(w.pairs) + 2 * (1 + w.f32_blocks_format), [w.packed, w.f32_blocks]
        return 1, (1 if w.pairs else 0), [w.packed]  # format 1: a gate_up in the paired layout
    if kind is Q4BlocksLinear and w.native_ok():  # on the step's float32 or bf16 x, as the module calls it
        return 5, 0, [w.qs, w.d, w.m]
    if kind is Q8BlocksLinear and w.native_ok():
        return 6, 0, [w.qs, w.d]
    if not getattr(w, "invariant", False):
        return -1, 0, []
    if kind is Int4Linear:
        return 2, invariant.INT4, [w.tiles, w.tile_scale, w.tile_zero]
    if kind is Int8Linear:
        return 2, invariant.INT8, [w.tiles, w.scale]
    if kind is Q8_0Linear:
        return 2, invariant.Q8_0, [w.tiles, w.tile_d]
    if kind is GGUFBlockLinear and w.qtype in KIND:
        return 3, KIND[w.qtype], [w.tile_codes, w.tile_planes, w.tile_sup, w.tile_sub]
    return -1, 0, []


def _unsupported(model) -> str | None:
    """Why `model` cannot run on the native stack (None: it can)."""
    from tessera.kernels.linear import InvariantLinear
    from tessera.model.layers import RMSNorm, SwiGLUMLP
    from tessera.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM) or type(model).forward is not LlamaForCausalLM.forward:
        return f"{type(model).__name__} is not a plain llama model"
    if model.dtype not in (torch.bfloat16, torch.float32) or not kernels.available():
        return "no native kernels for this dtype"
    probe = torch.empty(0, dtype=model.dtype)
    if not kernels.fused(probe):
        return "the fused elementwise kernels need AVX-512 bf16"
    if type(model.attn_backend) is not InvariantCPUAttention or model.config.head_dim not in _HEAD_DIMS:
        return "the attention backend is not the invariant CPU kernel"
    if type(model.norm) is not RMSNorm or not model.layers:
        return "no plain final RMSNorm"
    eps = model.layers[0].input_layernorm.eps
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if (type(layer) is not LlamaDecoderLayer or type(attn) is not LlamaAttention or type(mlp) is not SwiGLUMLP
                or attn.q_norm is not None):
            return f"layer {i} is not the plain llama layer"
        if type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm:
            return f"layer {i} has another norm"
        if {layer.input_layernorm.eps, layer.post_attention_layernorm.eps, model.norm.eps} != {eps}:
            return "the norms' eps differ"
        for w in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            kind = _linear_spec(w)[0]
            if kind < 0 or (type(w) is InvariantLinear and w.dtype != model.dtype):
                return f"layer {i} has a weight off the batch-invariant kernels ({type(w).__name__})"
        if attn.qkv_bias is not None and attn.qkv_bias.dtype != model.dtype:
            return f"layer {i}'s qkv bias is not {model.dtype}"
        if attn.backend is not model.attn_backend or attn.scale != model.layers[0].self_attn.scale:
            return f"layer {i} has its own attention backend or scale"
    return None
