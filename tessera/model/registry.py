"""Which model class serves which checkpoint, and `build_model`, the one way to make a model.

`ARCHITECTURES` lists every family tessera runs: our name (the Hugging Face `model_type`), the
HF `architectures` class names, the GGUF `general.architecture` names, and the class, imported
on first use. Loaders ask this file what they support; the engine, the draft model and the
quality tool all build their model with `build_model`. A new family is one file and one line here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from tessera.config import ModelConfig


@dataclass(frozen=True)
class Architecture:
    name: str  # ModelConfig.architecture, and the HF model_type
    hf_architectures: tuple[str, ...]  # config.json "architectures"
    gguf_names: tuple[str, ...]  # GGUF general.architecture
    model_class: str  # "module:Class", imported on first use
    hf_model_types: tuple[str, ...] = ()  # other config.json model_type spellings


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("llama", ("LlamaForCausalLM",), ("llama",), "tessera.model.llama:LlamaForCausalLM"),
    # Mistral GGUFs say "llama"; the loader tells them apart by their name.
    Architecture("mistral", ("MistralForCausalLM",), (), "tessera.model.llama:LlamaForCausalLM"),
    Architecture("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), "tessera.model.llama:LlamaForCausalLM"),
    Architecture("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), "tessera.model.qwen3:Qwen3ForCausalLM"),
    Architecture("gemma3", ("Gemma3ForCausalLM",), ("gemma3",), "tessera.model.gemma3:Gemma3ForCausalLM",
                 hf_model_types=("gemma3_text",)),
    Architecture("phi3", ("Phi3ForCausalLM",), ("phi3",), "tessera.model.phi3:Phi3ForCausalLM"),
)}


def supported_line() -> str:
    """One line naming what tessera runs, for error messages."""
    return "supported: " + ", ".join(f"{a.name} ({'/'.join(a.hf_architectures)})" for a in ARCHITECTURES.values())


def architecture_from_hf(model_type: str | None, hf_architectures: list[str] | None, where: str) -> str:
    """Our architecture name for a config.json, or ValueError naming the supported ones."""
    for arch in ARCHITECTURES.values():
        if model_type == arch.name or model_type in arch.hf_model_types:
            return arch.name
    for arch in ARCHITECTURES.values():
        if set(hf_architectures or ()) & set(arch.hf_architectures):
            return arch.name
    raise ValueError(f"{where}: model_type {model_type!r} (architectures {hf_architectures}) is not supported; "
                     f"{supported_line()}")


def architecture_from_gguf(gguf_name: str, where: str) -> str:
    for arch in ARCHITECTURES.values():
        if gguf_name in arch.gguf_names:
            return arch.name
    names = ", ".join(n for a in ARCHITECTURES.values() for n in a.gguf_names)
    raise ValueError(f"{where}: GGUF architecture {gguf_name!r} is not supported; supported: {names}")


def model_class(architecture: str) -> type:
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is not supported; {supported_line()}")
    module_name, class_name = ARCHITECTURES[architecture].model_class.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def expected_weight_names(config: ModelConfig) -> list[str]:
    """The Hugging Face names a checkpoint of this config must hold (read off the model class
    built on the meta device, so no memory is taken)."""
    return model_class(config.architecture)(config, torch.float32, device="meta", attn_backend="torch").weight_names()


def build_model(files, dtype: torch.dtype, device: str | torch.device = "cpu", attn_backend: str = "auto",
                quantization: str = "none", quantize_lm_head: bool = False, quant_group_size: int = 32,
                sparsity: str = "none"):
    """Construct the model for `files` (a tessera.model.weights.ModelFiles), load its weights,
    quantize them as asked (tessera.quant.quantize_model) and return it in eval mode."""
    from tessera.quant import quantize_model

    model = model_class(files.config.architecture)(files.config, dtype, device=device, attn_backend=attn_backend)
    model.load_weights(files.weights())
    quantize_model(model, quantization, quantize_lm_head=quantize_lm_head, group_size=quant_group_size,
                   model_files=files, sparsity=sparsity)
    return model.eval()
