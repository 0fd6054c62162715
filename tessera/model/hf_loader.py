"""Read a Hugging Face model folder: config.json (+ generation_config.json) and *.safetensors.

Names in these checkpoints already are the Hugging Face names the model expects; this file maps
the config (both the transformers 4 `rope_theta`/`rope_scaling` keys and the transformers 5
`rope_parameters` dict, per layer type for Gemma 3) and streams tensors one at a time with
`safetensors.safe_open`. Which families exist is tessera.model.registry's business.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tessera.config import ModelConfig
from tessera.model.registry import architecture_from_hf, supported_line
from tessera.model.weights import ModelFiles, expected_weight_names

logger = logging.getLogger("tessera")
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
                f"{self.path}: tensors this {self.config.architecture} model cannot use, e.g. "
                f"{sorted(unknown)[:3]} ({len(unknown)} in all); tessera's families have no o_proj / MLP "
                f"biases ({supported_line()})"
            )


def config_from_hf(hf: dict, generation: dict, tensor_names: set[str], path: Path) -> ModelConfig:
    """A ModelConfig from config.json (+ generation_config.json) and the checkpoint's tensor names."""
    if "text_config" in hf:
        raise ValueError(f"{path}: a multimodal checkpoint ({hf.get('architectures')}); tessera runs text-only "
                         f"models, {supported_line()}")
    arch = architecture_from_hf(hf.get("model_type"), hf.get("architectures"), str(path))
    rope_theta, rope_scaling, local_theta = _rope(hf)
    hidden, num_heads = hf["hidden_size"], hf["num_attention_heads"]
    num_layers = hf["num_hidden_layers"]
    max_positions = hf.get("max_position_embeddings", 2048)
    window, layer_types = _sliding_window(hf, arch, num_layers)
    eos: list[int] = []
    for source in (hf, generation):
        ids = source.get("eos_token_id")
        eos += [ids] if isinstance(ids, int) else list(ids or [])
    return ModelConfig(
        architecture=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hidden // num_heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        # Transformers ties when the config says so, whatever the file holds; a file without
        # lm_head can only be tied.
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", arch == "gemma3")) or "lm_head.weight" not in tensor_names,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in tensor_names,
        bos_token_id=hf["bos_token_id"] if hf.get("bos_token_id") is not None else generation.get("bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        sliding_window=window,
        layer_types=layer_types,
        hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "silu",
        rope_local_theta=local_theta,
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
        final_logit_softcapping=hf.get("final_logit_softcapping"),
    )


def _sliding_window(hf: dict, arch: str, num_layers: int) -> tuple[int | None, tuple[str, ...] | None]:
    """(window, per-layer types) as transformers reads them: Mistral and Phi-3 window every layer
    when `sliding_window` is set, Qwen2 only with use_sliding_window (from max_window_layers on),
    Gemma 3 its "sliding_attention" layers (every layer but each sixth by default)."""
    window = hf.get("sliding_window")
    if not window or not hf.get("use_sliding_window", arch != "qwen2"):
        return None, None
    if hf.get("layer_types"):
        return int(window), tuple(hf["layer_types"])
    if arch == "gemma3":
        pattern = hf.get("sliding_window_pattern", 6)
        return int(window), tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                                  for i in range(num_layers))
    if arch == "qwen2":
        first = hf.get("max_window_layers", num_layers)
        return int(window), tuple("sliding_attention" if i >= first else "full_attention" for i in range(num_layers))
    return int(window), None


def _rope(hf: dict) -> tuple[float, dict | None, float | None]:
    """(rope_theta, HF-style rope_scaling or None, the sliding layers' rope_theta or None) from
    either config.json dialect; Gemma 3 has one rope per layer type."""
    params = hf.get("rope_parameters")
    local_theta = hf.get("rope_local_base_freq")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):  # per layer type
        local_theta = params.get("sliding_attention", {}).get("rope_theta", local_theta)
        params = params["full_attention"]
    if isinstance(params, dict):  # transformers >= 5
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = hf.get("rope_theta", 10000.0)
        scaling = dict(hf.get("rope_scaling") or {})
    if "type" in scaling:  # the older spelling of rope_type
        scaling.setdefault("rope_type", scaling.pop("type"))
    local = float(local_theta) if local_theta is not None else None
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None, local
    return float(theta), scaling, local
