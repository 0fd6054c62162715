"""Read a Hugging Face model folder: config.json (+ generation_config.json) and *.safetensors.

Names in these checkpoints already are the Hugging Face Llama names the model expects; this file
maps the config (both the transformers 4 `rope_theta`/`rope_scaling` keys and the transformers 5
`rope_parameters` dict) and streams tensors one at a time with `safetensors.safe_open`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tessera.config import ModelConfig
from tessera.model.weights import ModelFiles, expected_weight_names

logger = logging.getLogger("tessera")

SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# Buffers some old checkpoints saved; recomputed by the model, never loaded.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class HFModelFiles(ModelFiles):
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        hf = json.loads((self.path / "config.json").read_text())
        generation = {}
        if (self.path / "generation_config.json").is_file():
            generation = json.loads((self.path / "generation_config.json").read_text())
        self.tensor_files = self._index_tensors()
        self.config = config_from_hf(hf, generation, set(self.tensor_files), self.path)
        self._check_names()
        logger.info("opened HF folder %s: %s, %d layers, %d tensor files", self.path,
                    self.config.architecture, self.config.num_layers, len(set(self.tensor_files.values())))

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        wanted = set(expected_weight_names(self.config))
        by_file: dict[Path, list[str]] = {}
        for name, file in self.tensor_files.items():
            if name in wanted:
                by_file.setdefault(file, []).append(name)
        for file, names in by_file.items():
            with safe_open(file, framework="pt") as f:
                for name in names:
                    yield name, f.get_tensor(name)

    def _index_tensors(self) -> dict[str, Path]:
        """Tensor name -> the safetensors file that holds it."""
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            found = ", ".join(sorted(p.name for p in self.path.iterdir())) or "nothing"
            raise FileNotFoundError(
                f"{self.path}: no *.safetensors files (found: {found}); tessera reads safetensors "
                f"or GGUF, re-save the model with save_pretrained(safe_serialization=True)"
            )
        index: dict[str, Path] = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    index[name] = file
        return index

    def _check_names(self) -> None:
        present = {n for n in self.tensor_files if not n.endswith(_IGNORED_SUFFIXES)}
        expected = set(expected_weight_names(self.config))
        if missing := expected - present:
            raise ValueError(f"{self.path}: missing tensors, e.g. {sorted(missing)[:3]} ({len(missing)} in all)")
        if unknown := present - expected - {"lm_head.weight"}:
            raise ValueError(
                f"{self.path}: tensors this Llama-family model cannot use, e.g. {sorted(unknown)[:3]} "
                f"({len(unknown)} in all); tessera supports {', '.join(SUPPORTED_MODEL_TYPES.values())} "
                f"without o_proj / MLP biases"
            )


def config_from_hf(hf: dict, generation: dict, tensor_names: set[str], path: Path) -> ModelConfig:
    """A ModelConfig from config.json (+ generation_config.json) and the checkpoint's tensor names."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{path}: model_type {model_type!r} (architectures {hf.get('architectures')}) is not "
            f"supported; supported: {', '.join(f'{k} ({v})' for k, v in SUPPORTED_MODEL_TYPES.items())}"
        )
    rope_theta, rope_scaling = _rope(hf)
    hidden, num_heads = hf["hidden_size"], hf["num_attention_heads"]
    max_positions = hf.get("max_position_embeddings", 2048)
    window = hf.get("sliding_window")
    if window and hf.get("use_sliding_window", model_type == "mistral") and window < max_positions:
        logger.warning("%s: sliding window attention (%d tokens) is not implemented; attending to "
                       "the full context, which differs from the reference past %d tokens", path, window, window)
    eos: list[int] = []
    for source in (hf, generation):
        ids = source.get("eos_token_id")
        eos += [ids] if isinstance(ids, int) else list(ids or [])
    return ModelConfig(
        architecture=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hidden // num_heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        # Transformers ties when the config says so, whatever the file holds; a file without
        # lm_head can only be tied.
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)) or "lm_head.weight" not in tensor_names,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in tensor_names,
        bos_token_id=hf["bos_token_id"] if hf.get("bos_token_id") is not None else generation.get("bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )


def _rope(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, HF-style rope_scaling or None) from either config.json dialect."""
    if isinstance(params := hf.get("rope_parameters"), dict):  # transformers >= 5
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = hf.get("rope_theta", 10000.0)
        scaling = dict(hf.get("rope_scaling") or {})
    if "type" in scaling:  # the older spelling of rope_type
        scaling.setdefault("rope_type", scaling.pop("type"))
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling
