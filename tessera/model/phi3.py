"""Phi-3: the Llama decoder whose checkpoints already fuse q/k/v (`self_attn.qkv_proj`) and
gate/up (`mlp.gate_up_proj`, gate rows first), in the row order our fused weights use, so each
loads whole. GGUF: attn_qkv and ffn_up (which holds gate and up). Rope scaling "longrope"
(the 128k variants) and partial rotary are not implemented: such configs are refused by
RotaryEmbedding's rope type check."""

from __future__ import annotations

from typing import ClassVar

from tessera.model.base import WeightTargets, whole
from tessera.model.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    GGUF_LAYER_NAMES: ClassVar[dict[str, str]] = {
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_up": "mlp.gate_up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }

    def _weight_targets(self) -> WeightTargets:
        targets = {name: target for name, target in super()._weight_targets().items()
                   if not name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight",
                                         "gate_proj.weight", "up_proj.weight"))}
        for i, layer in enumerate(self.layers):
            targets[f"model.layers.{i}.self_attn.qkv_proj.weight"] = whole(layer.self_attn.qkv_proj)
            targets[f"model.layers.{i}.mlp.gate_up_proj.weight"] = whole(layer.mlp.gate_up_proj)
        return targets
