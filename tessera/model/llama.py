"""The Llama-family decoder over a paged KV cache: Llama 2/3, Mistral, Qwen2, SmolLM (and the
base of Qwen3 and Phi-3, which add to it in their own files).

The forward pass works on the flattened batch of one step (no batch dim): T tokens, each with
its position, attending through the attention backend to the cache as the step's
`AttentionMetadata` describes. q/k/v and gate/up are fused into one weight each at load time.
A layer with a sliding window (Mistral, config.layer_window) passes it to the backend.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.attention.backend import AttentionBackend
from tessera.attention.metadata import AttentionMetadata
from tessera.config import ModelConfig
from tessera.model.base import CausalLM, KVCache, WeightTargets, whole
from tessera.model.layers import RMSNorm, RopeAt, RotaryEmbedding, SwiGLUMLP, _empty_param, embedding, linear


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend, dtype: torch.dtype, device,
                 qk_norm: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.backend = backend
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.layer_window(layer_idx)
        qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = _empty_param(qkv_rows, config.hidden_size, dtype=dtype, device=device)
        # attention_bias (Qwen2) means biases on q, k and v; o_proj never has one here.
        self.qkv_bias = _empty_param(qkv_rows, dtype=dtype, device=device) if config.attention_bias else None
        self.o_proj = _empty_param(config.hidden_size, config.num_heads * config.head_dim, dtype=dtype, device=device)
        # Qwen3: RMSNorm over each head of q and k, before rotary.
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device) if qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device) if qk_norm else None

    def forward(self, x: torch.Tensor, rope: RopeAt, kv_cache: KVCache, metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(x, self.qkv_proj, self.qkv_bias)
        qk = qkv[:, : (h + hkv) * d].view(num_tokens, h + hkv, d)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])], dim=1)
        # Rotate q and k together: one pass for both.
        qk = rope.apply(qk)
        v = qkv[:, (h + hkv) * d :].view(num_tokens, hkv, d)
        out = self.backend.forward(self.layer_idx, qk[:, :h], qk[:, h:], v, kv_cache, metadata, self.scale,
                                   sliding_window=self.sliding_window)
        return linear(out, self.o_proj)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend, dtype: torch.dtype, device,
                 qk_norm: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(config, layer_idx, backend, dtype, device, qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, dtype, device)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeAt,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            x = self.input_layernorm(hidden)
        else:
            x, residual = self.input_layernorm(hidden, residual)
        x = self.self_attn(x, rope, kv_cache, metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(CausalLM):
    """Llama-family causal LM (the CausalLM contract in tessera.model.base)."""

    QK_NORM = False  # Qwen3 sets it

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        attn_backend: str | AttentionBackend = "auto",
    ):
        super().__init__(config, dtype, device, attn_backend)
        self.embed_tokens = _empty_param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.attn_backend, dtype, device, self.QK_NORM)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        if config.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = _empty_param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings, device
        )
        # The whole decoder stack as one native call, where the engine built one (None: the modules).
        self.native_stack = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T] long -> final (normed) hidden states [T, hidden]."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for a model with {len(self.layers)} layers")
        self.attn_backend.begin_step(attn_metadata)
        hidden = embedding(input_ids, self.embed_tokens)
        if self.native_stack is not None:  # one native call for every layer (tessera/model/native_stack.py)
            out = self.native_stack.forward(hidden, positions, kv_caches, attn_metadata)
            if out is not None:
                return out
        rope = self.rotary.at(positions, self.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, rope, kv_cache, attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    # ---- weight loading -------------------------------------------------------------------

    def _weight_targets(self) -> WeightTargets:
        cfg = self.config
        q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size
        targets = {"model.embed_tokens.weight": whole(self.embed_tokens), "model.norm.weight": whole(self.norm.weight)}
        if not cfg.tie_word_embeddings:
            targets["lm_head.weight"] = whole(self.lm_head)
        for i, layer in enumerate(self.layers):
            pre, attn = f"model.layers.{i}.", layer.self_attn
            qkv_slices = {"q": (0, q_rows), "k": (q_rows, q_rows + kv_rows), "v": (q_rows + kv_rows, q_rows + 2 * kv_rows)}
            for name, (start, end) in qkv_slices.items():
                targets[f"{pre}self_attn.{name}_proj.weight"] = (attn.qkv_proj, start, end)
                if attn.qkv_bias is not None:
                    targets[f"{pre}self_attn.{name}_proj.bias"] = (attn.qkv_bias, start, end)
            if attn.q_norm is not None:
                targets[f"{pre}self_attn.q_norm.weight"] = whole(attn.q_norm.weight)
                targets[f"{pre}self_attn.k_norm.weight"] = whole(attn.k_norm.weight)
            targets[f"{pre}self_attn.o_proj.weight"] = whole(attn.o_proj)
            targets[f"{pre}mlp.gate_proj.weight"] = (layer.mlp.gate_up_proj, 0, inter)
            targets[f"{pre}mlp.up_proj.weight"] = (layer.mlp.gate_up_proj, inter, 2 * inter)
            targets[f"{pre}mlp.down_proj.weight"] = whole(layer.mlp.down_proj)
            targets[f"{pre}input_layernorm.weight"] = whole(layer.input_layernorm.weight)
            targets[f"{pre}post_attention_layernorm.weight"] = whole(layer.post_attention_layernorm.weight)
        return targets
