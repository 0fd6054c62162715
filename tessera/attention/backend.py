"""The attention backend interface and the registry that picks one by name.

A backend owns two things per layer and step: writing the step's new K/V into the paged cache,
and computing attention of the step's queries over each sequence's cached context. Everything
else (projections, rotary, the batch layout) belongs to the model and the model runner.
"""

from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod

import torch

from tessera.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Paged attention over the flattened batch described by `AttentionMetadata`.

    Contract of `forward(layer_idx, q, k, v, kv_cache, metadata, scale, sliding_window=None) -> [T, H*d]`:

    - Shapes: q [T, H, d], k and v [T, Hkv, d] (rotary already applied; they may be strided
      views), with Hkv dividing H (MHA, GQA, MQA). kv_cache is this layer's `(k_cache, v_cache)`,
      each [num_slots, Hkv, d] as laid out in `tessera.attention.metadata`.
    - First, the new k/v of every token t are written to slot `metadata.slot_mapping[t]` (one
      `index_copy_` per tensor, cast to the cache dtype). Then attention is computed, so a token
      sees its own K/V and everything written in earlier steps.
    - The first `num_decode_tokens` tokens are decodes, one per sequence: query i attends to the
      cache rows `decode_slots[i]` where `decode_mask[i]` is True.
    - Each `PrefillSpan` attends to its `context_slots`, causally with the offset
      `context_len - query_len` (query row j sees context positions 0 .. offset + j).
    - Returns the attention output in q's dtype, heads concatenated: [T, H * d].
    - `sliding_window` W (optional, None = the whole context): query at position p attends only
      to positions p - W + 1 .. p. Context slots behind the window may point at block 0.
    - Block 0 (slots 0 .. block_size-1) is the padding target: it must hold finite values (the
      cache from `allocate_kv_cache` is zero-filled) since masked-out rows still enter a matmul.

    Per-step work that is the same for every layer (index tensors, masks) is done once: the
    model calls `begin_step(metadata)` before layer 0, and backends key what they derive on the
    metadata object, so the runner must build a fresh `AttentionMetadata` for every step (or call
    `begin_step` again after mutating one).
    """

    name: str = "abstract"
    # Whether the backend attends over int8/fp8 KV codes with scales (--kv-cache-dtype).
    supports_quantized_kv: bool = False

    def reads_shared_prefix(self, head_dim: int) -> bool:
        """Whether forward reads `metadata.decode_shared_len` (the cascade decode) for a model of
        this head_dim. The model runner measures the decodes' shared prefix (a few tensor ops a
        step) only where it does. Default: no."""
        return False

    def begin_step(self, metadata: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Called by the model once per forward, before the first layer. Default: nothing."""

    @abstractmethod
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
        """Write k/v into kv_cache at metadata.slot_mapping, then attend; returns [T, H*d]."""


# name -> "module:ClassName", imported on first use so that optional backends (triton) cost
# nothing unless chosen.
_BACKENDS: dict[str, str] = {
    "torch": "tessera.attention.torch_cpu:TorchCPUAttention",
    "invariant": "tessera.attention.invariant_cpu:InvariantCPUAttention",
    "triton": "tessera.attention.triton_gpu:TritonAttention",
}


def register_attention_backend(name: str, target: str) -> None:
    """Make a backend selectable by name; `target` is "package.module:ClassName"."""
    _BACKENDS[name] = target


def available_attention_backends() -> list[str]:
    return ["auto", *_BACKENDS]


def get_attention_backend(name: str = "auto", device: str | torch.device = "cpu") -> AttentionBackend:
    """Instantiate the backend called `name`; "auto" picks the best one for `device`: on CPU the
    batch-invariant C++ kernel (tessera/kernels) when it builds, else torch; on CUDA triton when
    the triton package is installed, else torch."""
    if name == "auto":
        is_cuda = torch.device(device).type == "cuda"
        has_triton = "triton" in _BACKENDS and importlib.util.find_spec("triton") is not None
        if is_cuda:
            name = "triton" if has_triton else "torch"
        else:
            from tessera import kernels

            name = "invariant" if kernels.available() else "torch"
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(available_attention_backends())}"
        )
    module_name, class_name = _BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls()
