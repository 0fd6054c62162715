"""Gemma 3 (text): the decoder of Gemma 3 270M .. 27B over a paged KV cache.

What differs from Llama, each as transformers' Gemma3ForCausalLM computes it:
- embeddings scaled by sqrt(hidden) (rounded to the model dtype first), lm_head tied to them;
- four RMSNorms a layer (before and after attention, before and after the MLP), each scaling
  by (1 + w) in float32, and RMSNorm over each head of q and k before rotary;
- GeGLU MLP (tanh GELU);
- local layers (sliding window, rope base `rope_local_theta`, 10k) interleaved with global
  ones (the whole context, `rope_theta` with its scaling), per `config.layer_types`;
- attention scale query_pre_attn_scalar ** -0.5; optional final logit soft-capping.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from tessera.attention.backend import AttentionBackend
from tessera.attention.metadata import AttentionMetadata
from tessera.config import ModelConfig
from tessera.model.base import CausalLM, KVCache, WeightTargets, whole
from tessera.model.layers import GeGLUMLP, GemmaRMSNorm, RopeAt, RotaryEmbedding, _empty_param, embedding, linear

# llama.cpp's Gemma 3 layer pattern and local rope base, which GGUF files do not store.
GGUF_SLIDING_PATTERN = 6
DEFAULT_LOCAL_THETA = 10000.0


class Gemma3Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend, dtype: torch.dtype, device):
        super().__init__()
        self.layer_idx = layer_idx
        self.backend = backend
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.sliding_window = config.layer_window(layer_idx)
        qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = _empty_param(qkv_rows, config.hidden_size, dtype=dtype, device=device)
        self.o_proj = _empty_param(config.hidden_size, config.num_heads * config.head_dim, dtype=dtype, device=device)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, rope: RopeAt, kv_cache: KVCache, metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(x, self.qkv_proj)
        q = rope.apply(self.q_norm(qkv[:, : h * d].view(num_tokens, h, d)))
        k = rope.apply(self.k_norm(qkv[:, h * d : (h + hkv) * d].view(num_tokens, hkv, d)))
        v = qkv[:, (h + hkv) * d :].view(num_tokens, hkv, d)
        out = self.backend.forward(self.layer_idx, q, k, v, kv_cache, metadata, self.scale,
                                   sliding_window=self.sliding_window)
        return linear(out, self.o_proj)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend, dtype: torch.dtype, device):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.is_local = config.layer_window(layer_idx) is not None
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.self_attn = Gemma3Attention(config, layer_idx, backend, dtype, device)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.mlp = GeGLUMLP(hidden, config.intermediate_size, dtype, device)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)

    def forward(self, hidden: torch.Tensor, rope: RopeAt, kv_cache: KVCache, metadata: AttentionMetadata) -> torch.Tensor:
        x = self.self_attn(self.input_layernorm(hidden), rope, kv_cache, metadata)
        hidden = hidden + self.post_attention_layernorm(x)
        x = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(x)


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 text model (the CausalLM contract in tessera.model.base)."""

    GGUF_LAYER_NAMES: ClassVar[dict[str, str]] = {
        **CausalLM.GGUF_LAYER_NAMES,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "attn_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
    GGUF_NORM_OFFSET: ClassVar[float] = 1.0

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 attn_backend: str | AttentionBackend = "auto"):
        super().__init__(config, dtype, device, attn_backend)
        self.embed_tokens = _empty_param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, self.attn_backend, dtype, device) for i in range(config.num_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        if config.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = _empty_param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        max_pos = config.max_position_embeddings
        self.rotary_global = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, max_pos, device)
        self.rotary_local = RotaryEmbedding(config.head_dim, config.rope_local_theta or DEFAULT_LOCAL_THETA, None,
                                            max_pos, device)
        # transformers keeps sqrt(hidden) as a float32 buffer and rounds it to the weight dtype.
        self.embed_scale = torch.tensor(config.hidden_size**0.5).to(dtype).item()
        # The decoder stack as one native call, where the engine built one (gemma_stack.py; None: the modules).
        self.native_stack = None

    @classmethod
    def gguf_config(cls, fields: dict, hparam: Callable[..., object]) -> dict:
        num_layers, head_dim = fields["num_layers"], fields["head_dim"]
        # llama.cpp: attention scale 1/sqrt(head_dim), but 1/sqrt(hidden / heads) for the 27B (62 layers).
        scalar = fields["hidden_size"] // fields["num_heads"] if num_layers == 62 else head_dim
        return dict(
            sliding_window=int(hparam("attention.sliding_window", 4096)),
            layer_types=tuple("sliding_attention" if (i + 1) % GGUF_SLIDING_PATTERN else "full_attention"
                              for i in range(num_layers)),
            rope_local_theta=DEFAULT_LOCAL_THETA,
            query_pre_attn_scalar=float(scalar),
            hidden_act="gelu_pytorch_tanh",
        )

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] long -> final (normed) hidden states [T, hidden]."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for a model with {len(self.layers)} layers")
        self.attn_backend.begin_step(attn_metadata)
        rope_global = self.rotary_global.at(positions, self.dtype)
        rope_local = self.rotary_local.at(positions, self.dtype)
        hidden = embedding(input_ids, self.embed_tokens) * self.embed_scale
        if self.native_stack is not None:
            out = self.native_stack.forward(hidden, positions, kv_caches, attn_metadata)
            if out is not None:
                return out
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, rope_local if layer.is_local else rope_global, kv_cache, attn_metadata)
        return self.norm(hidden)

    def _weight_targets(self) -> WeightTargets:
        cfg = self.config
        q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size
        targets = {"model.embed_tokens.weight": whole(self.embed_tokens), "model.norm.weight": whole(self.norm.weight)}
        if not cfg.tie_word_embeddings:
            targets["lm_head.weight"] = whole(self.lm_head)
        for i, layer in enumerate(self.layers):
            pre, attn = f"model.layers.{i}.", layer.self_attn
            targets[f"{pre}self_attn.q_proj.weight"] = (attn.qkv_proj, 0, q_rows)
            targets[f"{pre}self_attn.k_proj.weight"] = (attn.qkv_proj, q_rows, q_rows + kv_rows)
            targets[f"{pre}self_attn.v_proj.weight"] = (attn.qkv_proj, q_rows + kv_rows, q_rows + 2 * kv_rows)
            targets[f"{pre}self_attn.o_proj.weight"] = whole(attn.o_proj)
            targets[f"{pre}mlp.gate_proj.weight"] = (layer.mlp.gate_up_proj, 0, inter)
            targets[f"{pre}mlp.up_proj.weight"] = (layer.mlp.gate_up_proj, inter, 2 * inter)
            targets[f"{pre}mlp.down_proj.weight"] = whole(layer.mlp.down_proj)
            for norm in ("self_attn.q_norm", "self_attn.k_norm", "input_layernorm", "post_attention_layernorm",
                         "pre_feedforward_layernorm", "post_feedforward_layernorm"):
                targets[f"{pre}{norm}.weight"] = whole(layer.get_submodule(norm).weight)
        return targets
