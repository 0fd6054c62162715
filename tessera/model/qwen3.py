"""Qwen3: the Llama decoder with an RMSNorm over each head of q and k before rotary (no q/k/v
bias). The norms' weights load from `self_attn.q_norm` / `k_norm` (GGUF: attn_q_norm / attn_k_norm)."""

from __future__ import annotations

from typing import ClassVar

from tessera.model.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    QK_NORM = True
    GGUF_LAYER_NAMES: ClassVar[dict[str, str]] = {
        **LlamaForCausalLM.GGUF_LAYER_NAMES,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    }
