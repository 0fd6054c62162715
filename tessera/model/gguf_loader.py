"""Read a llama.cpp GGUF file: its metadata into a ModelConfig, its tensors into HF-named weights.

Tensors are memory-mapped by `gguf.GGUFReader` and dequantized one at a time with
`gguf.quants.dequantize` (vectorized numpy), so loading never holds more than one dequantized
tensor. What llama.cpp's converter changed is undone here: it renamed every tensor
(`blk.N.attn_q` ...; each family's class lists its names), for the llama architecture it
permuted the rows of attn_q / attn_k so its rope could rotate adjacent pairs (Hugging Face
layers rotate the two halves of each head), and for Gemma it stored norm weights as 1 + w.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from tessera.config import ModelConfig
from tessera.model.registry import architecture_from_gguf, model_class
from tessera.model.weights import ModelFiles

logger = logging.getLogger("tessera")

# Types we read. All the block formats are dequantized by the gguf package; the IQ* and ternary
# formats it also knows are left out until something here tests them.
SUPPORTED_TYPES = (
    Q.F32, Q.F16, Q.BF16,
    Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
)

_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Precomputed llama3 rope factors; folded back into config.rope_scaling, not a weight.
_ROPE_FREQS = "rope_freqs.weight"
RowTransform = Callable[[torch.Tensor], torch.Tensor]


def gguf_name_map(model_cls: type, tensor_names) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, for the tensors of `tensor_names` that `model_cls`
    (a CausalLM class) knows."""
    mapping = {}
    for name in tensor_names:
        if name in model_cls.GGUF_GLOBAL_NAMES:
            mapping[name] = model_cls.GGUF_GLOBAL_NAMES[name]
        elif (m := _LAYER_PATTERN.fullmatch(name)) and m.group(2) in model_cls.GGUF_LAYER_NAMES:
            mapping[name] = f"model.layers.{m.group(1)}.{model_cls.GGUF_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return mapping


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's `w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2)` on rows."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFModelFiles(ModelFiles):
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.reader = _open_reader(self.path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.gguf_architecture = str(self._field("general.architecture"))
        self.model_class = model_class(architecture_from_gguf(self.gguf_architecture, str(self.path)))
        self.hf_names = gguf_name_map(self.model_class, self.tensors)
        self._gguf_names = {hf: g for g, hf in self.hf_names.items()}
        self._check_tensors()
        self.config = self._read_config()
        logger.info("opened GGUF %s: %s, %d layers, %d tensors", self.path.name,
                    self.config.architecture, self.config.num_layers, len(self.tensors))

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        offset = self.model_class.GGUF_NORM_OFFSET
        for t in self.reader.tensors:
            name = self.hf_names.get(t.name)
            if name is None:  # rope_freqs, already in the config
                continue
            w = _dequantize(t)
            if (transform := self.row_transform(name)) is not None:
                w = transform(w)
            if offset and name.endswith("norm.weight"):
                w = w - offset
            yield name, w

    def source_tensor(self, hf_name: str):
        """The GGUF tensor (a gguf ReaderTensor) holding the HF weight `hf_name`."""
        return self.tensors[self._gguf_names[hf_name]]

    def row_transform(self, hf_name: str) -> RowTransform | None:
        """What turns the rows of the GGUF tensor behind `hf_name` into the HF row order (llama's
        q/k rope permutation), or None; applies to any per-row tensor (codes, scales) as well."""
        if self.gguf_architecture != "llama":
            return None
        if hf_name.endswith("q_proj.weight"):
            return lambda w: unpermute_rope_rows(w, self.config.num_heads)
        if hf_name.endswith("k_proj.weight"):
            return lambda w: unpermute_rope_rows(w, self.config.num_kv_heads)
        return None

    def _field(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        value = field.contents()
        return value.item() if isinstance(value, np.generic) else value

    def _check_tensors(self) -> None:
        for t in self.reader.tensors:
            if t.tensor_type not in SUPPORTED_TYPES:
                raise ValueError(
                    f"{self.path}: tensor {t.name!r} has type {t.tensor_type.name}, which tessera "
                    f"cannot read; supported types: {', '.join(q.name for q in SUPPORTED_TYPES)}. "
                    f"Re-quantize the model to one of these (llama-quantize)."
                )
            if t.name not in self.hf_names and t.name != _ROPE_FREQS:
                raise ValueError(
                    f"{self.path}: unexpected tensor {t.name!r} for a {self.gguf_architecture} model "
                    f"({self.model_class.__name__} has no such parameter)"
                )
        for required in ("token_embd.weight", "output_norm.weight"):
            if required not in self.tensors:
                raise ValueError(f"{self.path}: tensor {required!r} is missing")

    def _read_config(self) -> ModelConfig:
        arch = self.gguf_architecture

        def hparam(key: str, default=None):
            value = self._field(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"{self.path}: metadata key {arch}.{key} is missing")
            return value

        hidden = hparam("embedding_length")
        num_heads = hparam("attention.head_count")
        head_dim = hparam("attention.key_length", hidden // num_heads)
        # GGUF shapes are (columns, rows): token_embd is (hidden, vocab).
        vocab_size = int(self.tensors["token_embd.weight"].shape[1])
        rope_theta = _float32(hparam("rope.freq_base", 10000.0))
        eos = [self._field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        name = str(self._field("general.name", "")).lower()
        ours = architecture_from_gguf(arch, str(self.path))
        fields = dict(
            architecture="mistral" if ours == "llama" and "mistral" in name else ours,
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=hparam("feed_forward_length"),
            num_layers=hparam("block_count"),
            num_heads=num_heads,
            num_kv_heads=hparam("attention.head_count_kv", num_heads),
            head_dim=head_dim,
            rms_norm_eps=_float32(hparam("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=self._rope_scaling(arch, rope_theta, head_dim),
            max_position_embeddings=hparam("context_length", 2048),
            tie_word_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
            bos_token_id=self._field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
        )
        # What llama.cpp hard-codes per family rather than stores (Gemma 3's layer pattern...).
        fields.update(self.model_class.gguf_config(fields, lambda key, default=None: self._field(f"{arch}.{key}", default)))
        return ModelConfig(**fields)

    def _rope_scaling(self, arch: str, rope_theta: float, head_dim: int) -> dict | None:
        if _ROPE_FREQS in self.tensors:
            factors = _dequantize(self.tensors[_ROPE_FREQS]).double().numpy()
            return llama3_scaling_from_factors(factors, rope_theta, head_dim, self.path)
        kind = self._field(f"{arch}.rope.scaling.type", "none")
        factor = self._field(f"{arch}.rope.scaling.factor") or self._field(f"{arch}.rope.scale_linear")
        if kind == "none" and factor is not None and factor != 1.0:
            kind = "linear"  # old files only have rope.scale_linear
        if kind == "none":
            return None
        if kind not in ("linear", "yarn"):
            raise ValueError(f"{self.path}: rope scaling {kind!r} is not supported (linear, yarn, llama3 are)")
        scaling = {"rope_type": kind, "factor": float(factor)}
        if kind == "yarn":
            original = self._field(f"{arch}.rope.scaling.original_context_length")
            if original is not None:
                scaling["original_max_position_embeddings"] = int(original)
            for key in ("beta_fast", "beta_slow"):
                if (value := self._field(f"{arch}.rope.scaling.yarn_{key}")) is not None:
                    scaling[key] = float(value)
        return scaling


def llama3_rope_factors(scaling: dict, rope_theta: float, head_dim: int) -> np.ndarray:
    """What llama.cpp's converter stores as rope_freqs for a llama3 rope_scaling dict: the divisor
    of each rotary frequency."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi * rope_theta ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = (original / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid))


def llama3_scaling_from_factors(factors: np.ndarray, rope_theta: float, head_dim: int, path: Path) -> dict:
    """Recover the HF llama3 rope_scaling dict from llama.cpp's rope_freqs tensor.

    Only the wavelength bounds original/low and original/high matter, so original is fixed at
    llama.cpp's 8192 and low/high are solved from the smoothly interpolated frequencies; the
    result is checked by recomputing the factors.
    """
    original = 8192
    factor = float(factors.max())
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": original}
    wavelen = 2 * math.pi * rope_theta ** (np.arange(0, head_dim, 2) / head_dim)
    mid = (factors > 1 + 1e-6) & (factors < factor - 1e-6)
    if mid.sum() >= 2 and factor > 1:
        # smooth = (1/f - 1/factor) / (1 - 1/factor) = (original/wavelen - low) / (high - low)
        smooth = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(original / wavelen[mid], smooth, 1)
        scaling["low_freq_factor"] = float(-intercept / slope)
        scaling["high_freq_factor"] = float((1 - intercept) / slope)
    if factors.shape != (head_dim // 2,) or not np.allclose(
        llama3_rope_factors(scaling, rope_theta, head_dim), factors, rtol=1e-4
    ):
        raise ValueError(f"{path}: rope_freqs does not match llama3 rope scaling; cannot read its rope")
    return scaling


def _float32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(value)))


class _Reader(gguf.GGUFReader):
    """gguf.GGUFReader over a plain ndarray view of the file's mapping.

    The reader parses every metadata field at open, one small slice of its `np.memmap` at a time,
    and each slice of a memmap runs numpy's memmap subclass hooks: for a 49k-token vocabulary and
    its merges (~100k strings) that was most of the 1.8 s an open took (Gemma 3's 262k-token
    vocabulary: 9 s). The same bytes through a plain view (the memmap stays alive as its base,
    read-only as before) parse in about a third of the time.
    """

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:  # GGUFReader.__init__ assigns its np.memmap here
        self._data = value.view(np.ndarray)


def _open_reader(path: Path) -> gguf.GGUFReader:
    try:
        reader = _Reader(path)
    except (ValueError, IndexError, KeyError, TypeError, OverflowError) as e:
        raise ValueError(f"{path}: cannot read GGUF ({e}); the file is truncated or not a GGUF file") from e
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ValueError(
                f"{path}: tensor {t.name!r} ends past the end of the file ({size} bytes); "
                f"the file is truncated or not a GGUF file"
            )
    return reader


def _dequantize(t) -> torch.Tensor:
    """A GGUF tensor as torch, numpy row-major shape (GGUF lists dims innermost first)."""
    if t.tensor_type in (Q.F32, Q.F16):
        return torch.from_numpy(np.array(t.data))  # copy out of the read-only memmap
    if t.tensor_type == Q.BF16:
        return torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False))
