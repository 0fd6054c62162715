"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) over a paged KV cache.

The forward pass works on the flattened batch of one step (no batch dim): T tokens, each with
its position, attending through the attention backend to the cache as the step's
`AttentionMetadata` describes. q/k/v and gate/up are fused into one weight each at load time.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tessera.attention.backend import AttentionBackend, get_attention_backend
from tessera.attention.metadata import AttentionMetadata
from tessera.config import ModelConfig
from tessera.model.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, _empty_param, apply_rotary, embedding, linear

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend, dtype: torch.dtype, device):
        super().__init__()
        self.layer_idx = layer_idx
        self.backend = backend
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = _empty_param(qkv_rows, config.hidden_size, dtype=dtype, device=device)
        # attention_bias (Qwen2) means biases on q, k and v; o_proj never has one here.
        self.qkv_bias = _empty_param(qkv_rows, dtype=dtype, device=device) if config.attention_bias else None
        self.o_proj = _empty_param(config.hidden_size, config.num_heads * config.head_dim, dtype=dtype, device=device)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(x, self.qkv_proj, self.qkv_bias)
        # Rotate q and k together: one set of elementwise ops for both.
        qk = apply_rotary(qkv[:, : (h + hkv) * d].view(num_tokens, h + hkv, d), cos, sin)
        v = qkv[:, (h + hkv) * d :].view(num_tokens, hkv, d)
        out = self.backend.forward(self.layer_idx, qk[:, :h], qk[:, h:], v, kv_cache, metadata, self.scale)
        return linear(out, self.o_proj)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend, dtype: torch.dtype, device):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(config, layer_idx, backend, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, dtype, device)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            x = self.input_layernorm(hidden)
        else:
            x, residual = self.input_layernorm(hidden, residual)
        x = self.self_attn(x, cos, sin, kv_cache, metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM. Weights are uninitialised until `load_weights`."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        attn_backend: str | AttentionBackend = "auto",
    ):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.attn_backend = (
            attn_backend if isinstance(attn_backend, AttentionBackend) else get_attention_backend(attn_backend, device)
        )
        self.embed_tokens = _empty_param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.attn_backend, dtype, device) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        if config.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = _empty_param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings, device
        )

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
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        hidden = embedding(input_ids, self.embed_tokens)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] (only the rows to sample) -> logits [n, vocab] in float32."""
        return linear(hidden, self.lm_head).float()

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> list[KVCache]:
        """Zero-filled (k_cache, v_cache) per layer, each [num_blocks * block_size, Hkv, head_dim].

        dtype defaults to the model dtype. Zero fill matters: block 0 is the padding target and
        must stay finite.
        """
        shape = (num_blocks * block_size, self.config.num_kv_heads, self.config.head_dim)
        dtype = dtype or self.dtype
        return [
            (torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in range(self.config.num_layers)
        ]

    # ---- weight loading -------------------------------------------------------------------

    def _weight_targets(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """HF parameter name -> (our parameter, first row, end row) it fills."""
        cfg = self.config
        q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size

        def whole(p: torch.Tensor) -> tuple[torch.Tensor, int, int]:
            return (p, 0, p.shape[0])

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
            targets[f"{pre}self_attn.o_proj.weight"] = whole(attn.o_proj)
            targets[f"{pre}mlp.gate_proj.weight"] = (layer.mlp.gate_up_proj, 0, inter)
            targets[f"{pre}mlp.up_proj.weight"] = (layer.mlp.gate_up_proj, inter, 2 * inter)
            targets[f"{pre}mlp.down_proj.weight"] = whole(layer.mlp.down_proj)
            targets[f"{pre}input_layernorm.weight"] = whole(layer.input_layernorm.weight)
            targets[f"{pre}post_attention_layernorm.weight"] = whole(layer.post_attention_layernorm.weight)
        return targets

    def _is_ignorable(self, name: str) -> bool:
        # Old checkpoints carry rotary inv_freq buffers; tied checkpoints may repeat lm_head.
        return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.config.tie_word_embeddings)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the fused parameters, casting to the model dtype.

        Raises ValueError on a tensor the model does not have, a shape mismatch, or (after the
        last tensor) any parameter that no tensor filled.
        """
        targets = self._weight_targets()
        loaded: set[str] = set()
        arch = self.config.architecture
        for name, tensor in weights:
            if name not in targets:
                if self._is_ignorable(name):
                    continue
                raise ValueError(
                    f"unexpected tensor {name!r} in the checkpoint of a {arch} model: this model has no such "
                    "parameter (is the checkpoint for a different architecture, or does config.json "
                    "disagree with the weights, e.g. attention_bias or tie_word_embeddings?)"
                )
            param, start, end = targets[name]
            dest = param[start:end]
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)} "
                    f"from the model config (hidden {self.config.hidden_size}, heads {self.config.num_heads}, "
                    f"kv heads {self.config.num_kv_heads}, head_dim {self.config.head_dim})"
                )
            dest.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) a {arch} model needs: {shown}")
