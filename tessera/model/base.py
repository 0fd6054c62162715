"""The `CausalLM` contract every model family implements, and the weight loading they share.

A family class (tessera/model/<family>.py, listed in tessera/model/registry.py) owns its whole
architecture: the forward pass over the paged KV cache, the logits, the Hugging Face names of
its parameters and how they fuse into its own (`_weight_targets`), its GGUF tensor names, and
its KV layout per layer. Nothing outside the family file knows the layout: the loaders ask
`registry.expected_weight_names`, quantization asks `linear_slots`, the KV pool asks
`allocate_kv_cache`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from tessera import memory
from tessera.attention.backend import AttentionBackend, get_attention_backend
from tessera.attention.metadata import AttentionMetadata
from tessera.config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]
# HF parameter name -> (our parameter, first row, end row) it fills.
WeightTargets = dict[str, tuple[torch.Tensor, int, int]]


@dataclass(frozen=True)
class LinearSlot:
    """A linear weight quantization may replace: `getattr(owner, attr)`, described as `name`
    ("layers.3.qkv_proj", "lm_head"), fused from the checkpoint tensors `parts` in row order."""

    owner: nn.Module
    attr: str
    name: str
    parts: tuple[str, ...]


@dataclass(frozen=True)
class LayerKV:
    """One layer's KV cache: heads and head size of its K/V, and its sliding window (None = all)."""

    num_kv_heads: int
    head_dim: int
    sliding_window: int | None


def kv_window(layout: list[LayerKV]) -> int | None:
    """How far back any layer reads (the blocks behind it can be freed), or None when some layer
    attends to the whole context."""
    windows = [layer.sliding_window for layer in layout]
    return None if not windows or any(w is None for w in windows) else max(windows)


class CausalLM(nn.Module, ABC):
    """A decoder-only LM over the paged KV cache. Weights are uninitialised until `load_weights`.

    Contract:
    - `forward(input_ids [T], positions [T], kv_caches, attn_metadata) -> hidden [T, hidden]`:
      the final normed hidden states of the flattened batch (see tessera.attention.metadata).
    - `compute_logits(hidden [n, hidden]) -> [n, vocab]` float32, for the rows to sample only.
    - `load_weights(pairs)` takes (Hugging Face name, tensor) pairs, as tessera.model.weights
      yields them, casting to the model dtype; it refuses unknown, misshapen or missing tensors.
    - `linear_slots(quantize_lm_head)`: the linear weights quantization may replace.
    - `kv_layout()`: per layer, the K/V shape and sliding window the KV pool and scheduler need.
    Subclasses set `layers` (an nn.ModuleList), `embed_tokens`, `lm_head` and implement
    `_weight_targets` and `forward`. Linear weights named `qkv_proj`, `o_proj` (on
    `layer.self_attn`), `gate_up_proj` and `down_proj` (on `layer.mlp`) are quantizable.
    """

    # GGUF (llama.cpp) tensor names: role in `blk.N.<role>.weight` -> HF module under
    # `model.layers.N.`, and the global tensors. A family adds its extra roles.
    GGUF_LAYER_NAMES: ClassVar[dict[str, str]] = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    GGUF_GLOBAL_NAMES: ClassVar[dict[str, str]] = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    # llama.cpp stores some families' norm weights as (offset + w) (Gemma: 1 + w); the loader
    # subtracts it so that the model sees the Hugging Face values.
    GGUF_NORM_OFFSET: ClassVar[float] = 0.0
    _QUANTIZABLE: ClassVar[tuple[tuple[str, str], ...]] = (
        ("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"),
    )

    layers: nn.ModuleList

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: str | torch.device,
                 attn_backend: str | AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.attn_backend = (
            attn_backend if isinstance(attn_backend, AttentionBackend) else get_attention_backend(attn_backend, device)
        )

    @classmethod
    def gguf_config(cls, fields: dict, hparam: Callable[..., object]) -> dict:
        """ModelConfig fields a GGUF file does not store but llama.cpp assumes for this family;
        `fields` holds what was read, `hparam(key, default)` reads `<arch>.<key>` metadata."""
        return {}

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata) -> torch.Tensor: ...

    @abstractmethod
    def _weight_targets(self) -> WeightTargets:
        """HF parameter name -> (our parameter, first row, end row) it fills."""

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] (only the rows to sample) -> logits [n, vocab] in float32."""
        from tessera.kernels.linear import InvariantLinear
        from tessera.model.layers import linear

        if isinstance(self.lm_head, InvariantLinear):
            logits = self.lm_head.forward_float(hidden)  # no bf16 [n, vocab] to widen after
        else:
            logits = linear(hidden, self.lm_head).float()
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def compute_logits_maxima(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(compute_logits(hidden), each row's maximum of every 16 logits where the lm_head's kernel
        finds them on the way, else None): a bf16 InvariantLinear (forward_float_maxima). Not with a
        logit softcap (the maxima would be of the logits before it)."""
        maxima = getattr(self.lm_head, "forward_float_maxima", None)
        if maxima is not None and not self.config.final_logit_softcapping:
            with torch.inference_mode():
                return maxima(hidden)
        return self.compute_logits(hidden), None

    def compute_logits_argmax(self, hidden: torch.Tensor, logits: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(compute_logits(hidden), each row's first maximum of those logits where the lm_head's
        kernel finds it on the way, else None): a bf16 InvariantLinear, or a quantized lm_head
        (QuantLinear.logits_argmax). Not with a logit softcap: tanh can round two different logits
        to one float and move the first maximum. `logits` False: the caller needs only the ids, so
        where a kernel gives them the logits are not stored ([rows, 0]); with None ids they are."""
        argmax = getattr(self.lm_head, "forward_float_argmax", None)
        if argmax is not None and not self.config.final_logit_softcapping:
            return argmax(hidden, logits)
        return self.compute_logits(hidden), None

    # ---- KV layout ------------------------------------------------------------------------

    def kv_layout(self) -> list[LayerKV]:
        cfg = self.config
        return [LayerKV(cfg.num_kv_heads, cfg.head_dim, cfg.layer_window(i)) for i in range(cfg.num_layers)]

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> list[KVCache]:
        """Zero-filled (k_cache, v_cache) per layer, each [num_blocks * block_size, Hkv, head_dim].

        dtype defaults to the model dtype. Zero fill matters: block 0 is the padding target and
        must stay finite.
        """
        dtype = dtype or self.dtype
        shapes = [(num_blocks * block_size, layer.num_kv_heads, layer.head_dim) for layer in self.kv_layout()]
        arena = memory.Arena([(shape, dtype) for shape in shapes for _ in range(2)], self.device)  # resident as used
        return [(arena.take(shape, dtype), arena.take(shape, dtype)) for shape in shapes]

    # ---- quantization slots ---------------------------------------------------------------

    def linear_slots(self, quantize_lm_head: bool = False) -> list[LinearSlot]:
        """Every linear weight `quantize_model` may replace, with the checkpoint tensors fused
        into each (read off `_weight_targets`, so the layout is written once)."""
        parts: dict[int, list[tuple[int, str]]] = {}
        for hf_name, (param, start, _) in self._weight_targets().items():
            parts.setdefault(id(param), []).append((start, hf_name))
        slots = []
        for i, layer in enumerate(self.layers):
            for module_name, attr in self._QUANTIZABLE:
                owner = getattr(layer, module_name)
                names = tuple(n for _, n in sorted(parts.get(id(getattr(owner, attr)), [])))
                slots.append(LinearSlot(owner, attr, f"layers.{i}.{attr}", names))
        if quantize_lm_head:
            source = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
            slots.append(LinearSlot(self, "lm_head", "lm_head", (source,)))
        return slots

    # ---- weight loading -------------------------------------------------------------------

    def weight_names(self) -> list[str]:
        """The HF names `load_weights` needs, all of them."""
        return list(self._weight_targets())

    def _is_ignorable(self, name: str) -> bool:
        # Old checkpoints carry rotary inv_freq buffers; tied checkpoints may repeat lm_head.
        return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.config.tie_word_embeddings)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters, casting to the model dtype.

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


def whole(p: torch.Tensor | nn.Module) -> tuple[torch.Tensor, int, int]:
    """A weight target filled by one tensor (p may already be a quantized layer: linear_slots
    reads the targets of a quantized model too; gguf mode's embedding is a QuantEmbedding, whose
    rows are those of the QuantLinear it wraps)."""
    if isinstance(p, torch.Tensor):
        return (p, 0, p.shape[0])
    return (p, 0, getattr(p, "layer", p).out_features)
