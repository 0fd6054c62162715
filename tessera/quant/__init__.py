"""Quantized linear layers (int8 and int4 weight-only, W8A8, GGUF-native blocks) and the code
that swaps them into a loaded model. See linear.py for the contract, one file per method."""

from tessera.quant.linear import (
    INT4_GROUP_SIZES,
    QUANTIZATION_METHODS,
    QuantLinear,
    check_quantization_args,
    quantize_model,
    weight_memory_bytes,
)

__all__ = [
    "INT4_GROUP_SIZES",
    "QUANTIZATION_METHODS",
    "QuantLinear",
    "check_quantization_args",
    "quantize_model",
    "weight_memory_bytes",
]
