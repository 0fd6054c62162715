"""The one entry point from model files to the model: `load_model_files(path) -> ModelFiles`.

Whatever the format on disk (a Hugging Face folder of safetensors, or a GGUF file), the model
sees the same thing: a `ModelConfig` and a lazy stream of `(hf_name, tensor)` pairs that use the
Hugging Face parameter names of its family (tessera.model.registry says which family). The
format-specific readers live in hf_loader.py and gguf_loader.py.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path

import torch

from tessera.config import ModelConfig


class ModelFiles(ABC):
    """A model on disk, opened: its config now, its weights when asked.

    Contract of `weights()`: yields each parameter once, as `(name, tensor)` with the Hugging Face
    names of `expected_weight_names(config)`, in no promised order, one tensor at a time
    (nothing is held after it is yielded, so peak memory is one tensor plus what the caller keeps).
    Tensors are float32, or the file's own float dtype (float16, bfloat16) where it stores one;
    quantized GGUF tensors come dequantized to float32. `lm_head.weight` is yielded only when
    `config.tie_word_embeddings` is False.
    """

    path: Path
    config: ModelConfig

    @abstractmethod
    def weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All weights at once: for tests and small models, not for the engine's load path."""
        return dict(self.weights())


def load_model_files(path: str | os.PathLike) -> ModelFiles:
    """Open a Hugging Face model folder (config.json + *.safetensors) or a .gguf file."""
    path = Path(path)
    if path.is_file() and (path.suffix == ".gguf" or _has_gguf_magic(path)):
        from tessera.model.gguf_loader import GGUFModelFiles

        return GGUFModelFiles(path)
    if path.is_dir() and (path / "config.json").is_file():
        from tessera.model.hf_loader import HFModelFiles

        return HFModelFiles(path)
    if path.is_dir() and len(ggufs := sorted(path.glob("*.gguf"))) == 1:
        from tessera.model.gguf_loader import GGUFModelFiles

        return GGUFModelFiles(ggufs[0])
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    raise ValueError(
        f"{str(path)!r} is not a model: expected a Hugging Face folder with config.json and "
        f"*.safetensors, a .gguf file, or a folder holding exactly one .gguf file"
    )


def expected_weight_names(config: ModelConfig) -> list[str]:
    """The names `ModelFiles.weights()` yields for this config (its family's Hugging Face layout)."""
    from tessera.model.registry import expected_weight_names as names

    return names(config)


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
