"""The quantized linear layer's contract, the registry of methods, and `quantize_model`.

A `QuantLinear` holds one weight [out_features, in_features] in a quantized format and computes
`x @ W.T` with whichever of its kernels is fastest for the number of rows in `x` (the kernel
choice per row count was measured on the development CPU; `benchmarks/quant.py --kernels`
re-measures it). The model calls it through `tessera.model.layers.linear`, which falls through to
`F.linear` for a plain float weight, so an unquantized model runs exactly as before.

`quantize_model` swaps the linear weights a loaded model lists in `CausalLM.linear_slots` (qkv,
o, gate_up, down; the lm_head only when asked) for QuantLinear modules. A tied lm_head gets its own quantized
copy; the embedding lookup keeps the float table.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from tessera.config import INT4_GROUP_SIZES, QUANTIZATION_METHODS, SPARSITY_PATTERNS

logger = logging.getLogger("tessera")



class QuantLinear(nn.Module, ABC):
    """y = x @ W.T (+ bias) with W kept quantized.

    Subclasses name their kernels in `kernels` (fastest-first is not implied) and pick one per
    call in `select_kernel(num_rows)`. Every kernel must agree with `x @ dequantize().T` within
    the tolerance the subclass documents; tests check each kernel against that reference.
    """

    method: str = ""
    kernels: tuple[str, ...] = ()

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.out_features = out_features
        self.in_features = in_features

    @abstractmethod
    def select_kernel(self, num_rows: int) -> str:
        """The kernel to run for a call with `num_rows` rows (tokens)."""

    @abstractmethod
    def run_kernel(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        """x [M, in_features] -> [M, out_features] in x's dtype, with the named kernel."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The weight the kernels compute with, as float32 [out_features, in_features]."""

    def weight_bytes(self) -> int:
        """Bytes this layer's weight takes in memory (codes, scales, zero points, packing)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None, kernel: str | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = self.run_kernel(kernel or self.select_kernel(rows.shape[0]), rows)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def forward_float_argmax(self, x: torch.Tensor, logits: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(forward(x).float(), each row's first maximum of it, or None): an lm_head's logits. A layer
        whose kernel finds the ids in its store epilogue (`logits_argmax`) gives them, so greedy
        sampling need not read the [rows, vocab] logits again; the others None. `logits` False: the
        caller needs only the ids, so where the kernel gives them the logits are not stored ([M, 0])."""
        got = self.logits_argmax(x, logits) if x.dim() == 2 and x.dtype == torch.bfloat16 else None
        return got if got is not None else (self(x).float(), None)

    def logits_argmax(self, x: torch.Tensor, logits: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        """bf16 x [M, K] -> (forward(x).float(), its rows' first maxima) in one kernel, or None; without
        `logits` the first is [M, 0]."""
        return None

    def extra_repr(self) -> str:
        return f"{self.method}, in_features={self.in_features}, out_features={self.out_features}"


# Dequantizing kernels work through the weight in row tiles of about this many float32 bytes:
# small enough to stay in cache between being written and being multiplied, large enough that
# the few tensor ops per tile cost little next to the tile's GEMM.
TILE_BYTES = 2 << 20
_scratch: dict[tuple[torch.dtype, torch.device, bool], torch.Tensor] = {}


def scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reused flat buffer of at least `numel` elements. Fresh multi-megabyte allocations are
    returned to the OS on free, and faulting their pages back in cost more than the dequantization
    itself (0.6 ms vs 0.2 ms to convert 1.8M int8 weights)."""
    # One buffer per inference-mode state: a buffer made under inference mode cannot be written
    # outside it (a kernel called directly after a model forward, as tests do).
    key = (dtype, device, torch.is_inference_mode_enabled())
    buf = _scratch.get(key)
    # A buffer made under inference_mode cannot be written outside it (a model forward makes
    # one, a kernel called directly later would fail): make a fresh one then.
    if buf is None or buf.numel() < numel or (buf.is_inference() and not torch.is_inference_mode_enabled()):
        buf = _scratch[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def tiled_matmul(x: torch.Tensor, out_features: int, tile_rows: int,
                 fill_tile: Callable[[int, int, torch.Tensor], None]) -> torch.Tensor:
    """x [M, K] @ W.T where `fill_tile(start, end, buf)` writes rows start..end-1 of W, in x's
    dtype, into buf [end - start, K]. Returns a contiguous [M, out_features] tensor."""
    m, k = x.shape
    if out_features <= 2 * tile_rows:  # a small weight: one tile, and y without a transpose
        w = scratch(out_features * k, x.dtype, x.device).view(out_features, k)
        fill_tile(0, out_features, w)
        return torch.mm(x, w.t())
    # Equal tiles (a multiple of tile_rows' granularity), not full ones and a sliver.
    num_tiles = -(-out_features // tile_rows)
    granule = tile_rows & -tile_rows  # the largest power of two dividing tile_rows (a block multiple)
    tile_rows = -(-out_features // num_tiles // granule) * granule
    buf = scratch(tile_rows * k, x.dtype, x.device)
    out_t = x.new_empty(out_features, m)  # y.T: each tile's rows are contiguous there
    for start in range(0, out_features, tile_rows):
        end = min(start + tile_rows, out_features)
        tile = buf[: (end - start) * k].view(end - start, k)
        fill_tile(start, end, tile)
        torch.mm(tile, x.t(), out=out_t[start:end])
    return out_t.t().contiguous()


def tile_rows_for(in_features: int, multiple: int = 1) -> int:
    rows = max(multiple, TILE_BYTES // (4 * in_features))
    return rows // multiple * multiple


# A quantizer turns a float weight [out, in] into a QuantLinear; `group_size` only matters to int4.
Quantizer = Callable[[torch.Tensor, int], QuantLinear]


def _quantizers() -> dict[str, Quantizer]:
    from tessera.quant.int4 import Int4Linear
    from tessera.quant.int8 import Int8Linear
    from tessera.quant.w8a8 import W8A8Linear

    return {
        "int8": lambda w, group_size: Int8Linear.from_float(w),
        "int4": lambda w, group_size: Int4Linear.from_float(w, group_size),
        "w8a8": lambda w, group_size: W8A8Linear.from_float(w),
    }


def check_quantization_args(method: str, group_size: int) -> None:
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"--quantization {method!r} is not supported; choose one of {', '.join(QUANTIZATION_METHODS)}")
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(
            f"--quant-group-size {group_size} is not supported; choose one of {', '.join(map(str, INT4_GROUP_SIZES))}"
        )


def linear_weight_slots(model: nn.Module, quantize_lm_head: bool) -> list[tuple[nn.Module, str, str]]:
    """(owning module, attribute, description) of every weight `quantize_model` replaces; the
    model says which they are (CausalLM.linear_slots)."""
    return [(s.owner, s.attr, s.name) for s in model.linear_slots(quantize_lm_head)]


def replace_weight(owner: nn.Module, name: str, layer: nn.Module) -> None:
    """Put `layer` where the Parameter `owner.<name>` was (a tied lm_head only loses its alias)."""
    owner._parameters.pop(name, None)
    setattr(owner, name, layer)


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    method: str,
    *,
    quantize_lm_head: bool = False,
    group_size: int = 32,
    model_files=None,
    sparsity: str = "none",
) -> nn.Module:
    """Quantize a loaded CausalLM (tessera.model.base) in place and return it.

    method: one of QUANTIZATION_METHODS. "gguf" needs `model_files`, the opened GGUF file the
    model was loaded from: its quantized blocks replace the (dequantized) float weights.
    sparsity "2:4" prunes the same weights first (tessera/quant/sparse.py): with method "none"
    they are stored compressed, otherwise the pruned weight is quantized.
    """
    check_quantization_args(method, group_size)
    if sparsity not in SPARSITY_PATTERNS:
        raise ValueError(f"--sparsity {sparsity!r}: choose one of {', '.join(SPARSITY_PATTERNS)}")
    if sparsity != "none" and method == "gguf":
        raise ValueError("--sparsity 2:4 cannot be combined with --quantization gguf: use none, int8, int4 or w8a8")
    if method == "none" and sparsity == "none":
        return model
    if method == "gguf":  # the lm_head computes from the file's own blocks: no loss to ask for
        quantize_lm_head = True
    slots = linear_weight_slots(model, quantize_lm_head)
    if sparsity != "none":
        _prune(slots, method)
        if method == "none":
            return model
    if method == "gguf":
        from tessera.quant.gguf_embedding import QuantEmbedding
        from tessera.quant.gguf_native import gguf_linears

        tied = model.config.tie_word_embeddings
        layers = gguf_linears(model, model_files, [desc for _, _, desc in slots] + ([] if tied else ["embed_tokens"]))
        for owner, name, desc in slots:
            if desc in layers:  # block types without a native kernel keep their float weight
                replace_weight(owner, name, layers[desc])
        table = layers.get("lm_head" if tied else "embed_tokens")
        if table is not None:  # look tokens up in the blocks; the float table is freed
            replace_weight(model, "embed_tokens", QuantEmbedding(table, model.dtype))
    else:
        quantize = _quantizers()[method]
        layers = {}
        for owner, name, desc in slots:
            weight = getattr(owner, name)
            try:
                layers[desc] = quantize(weight.detach().float(), group_size)
            except ValueError as e:
                raise ValueError(f"cannot quantize {desc} {tuple(weight.shape)} with {method}: {e}") from e
            replace_weight(owner, name, layers[desc])  # frees the float weight (not a tied embedding)
    pack_in_call_order([getattr(owner, name) for owner, name, _ in slots])
    logger.info("quantized %d linear weights with %s%s: %.1f MiB of weights", len(layers), method,
                " (lm_head included)" if quantize_lm_head else "", weight_memory_bytes(model) / 2**20)
    return model


def pack_in_call_order(weights: list) -> None:
    """The quantized layers' buffers moved into one buffer (on huge pages on CPU) in the order a
    decode step reads them, layer by layer and the lm_head last, as the bf16 weights
    (kernels/linear.py) and a bf16 engine's GGUF blocks (gguf_codes.py) are: a step streams them,
    and the prefetchers and the TLB see one stream. In separate allocations a step's Q4_1 linears
    at one row had run 13.8-16.9 ms against 11.1-11.8 ms (docs/kernels.md, session 27)."""
    from tessera import memory

    owners = [sub for w in weights if isinstance(w, QuantLinear) for sub in w.modules()]
    found = [(m, name, b) for m in owners for name, b in m._buffers.items() if b is not None]
    if not found:
        return
    device = found[0][2].device
    if any(b.device != device for _, _, b in found):
        return
    copies = memory.copies_in_order([b for _, _, b in found], device, huge=device.type == "cpu")
    for (m, name, _), copy in zip(found, copies, strict=True):
        m._buffers[name] = copy


def _prune(slots: list[tuple[nn.Module, str, str]], method: str) -> None:
    """2:4-prune every slot's weight: compressed Sparse24Linear layers for method "none", else
    the pruned float weight in place of the original (quantized next)."""
    from tessera.quant.sparse import Sparse24Linear, prune_2_4

    for owner, name, desc in slots:
        weight = getattr(owner, name)
        try:
            if method == "none":
                replace_weight(owner, name, Sparse24Linear.from_float(weight.detach()))
            else:
                replace_weight(owner, name, nn.Parameter(prune_2_4(weight.detach()), requires_grad=False))
        except ValueError as e:
            raise ValueError(f"cannot prune {desc} {tuple(weight.shape)} to 2:4: {e}") from e
    logger.info("pruned %d linear weights to 2:4 (%s); no sparse kernel speeds this up on CPU%s", len(slots),
                "stored compressed" if method == "none" else f"then quantized with {method}, stored dense",
                "" if method == "none" else ", so no memory is saved either")


def weight_memory_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds: float parameters (once each, tied ones once) plus
    quantized layers' codes and scales."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    for m in model.modules():
        if isinstance(m, QuantLinear):
            total += m.weight_bytes()
    return total
