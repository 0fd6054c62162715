"""Engine flags shared by `tessera generate`, `tessera serve` and the benchmarks.

One source per flag: `ENGINE_FLAGS` maps each `EngineConfig` field to its flag and help sentence;
defaults are read from the dataclass, so a flag's default cannot drift from the config's, and
`engine_kwargs` is derived from the same table. The README's flag table is generated from the
parsers that these build (tessera/flag_table.py); tests fail when any of them drift.

vLLM's names are accepted where Tessera has the feature (`--gpu-memory-utilization` is the KV
memory fraction, `--max-model-len`, `--enforce-eager`, ...). `--trust-remote-code` is accepted
with a note, and `--tensor-parallel-size N>1` is refused naming the alternative.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from tessera.config import (
    INT4_GROUP_SIZES,
    KV_CACHE_DTYPES,
    QUANTIZATION_METHODS,
    SPARSITY_PATTERNS,
    EngineConfig,
)

logger = logging.getLogger("tessera")


class UsageError(Exception):
    """A flag or argument the user got wrong: the CLI prints the message and exits 2."""


def parse_memory(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB' or plain bytes -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    try:
        for unit, mult in units.items():
            if t.endswith(unit):
                return int(float(t[: -len(unit)]) * mult)
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write e.g. 2GiB, 512MiB or 1000000") from None


@dataclass(frozen=True)
class EngineFlag:
    """One EngineConfig field's command-line flag (its default is the field's)."""

    field: str
    flag: str
    help: str
    type: Any = None
    choices: tuple | None = None
    boolean: bool = False  # --x / --no-x (BooleanOptionalAction) when the default is True, else store_true
    metavar: str | None = None


ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag("dtype", "--dtype", "Weights and activations: auto takes bfloat16 where the CPU has native bf16 "
               "(or on CUDA), else float32.", choices=("auto", "float32", "bfloat16", "float16")),
    EngineFlag("device", "--device", "Where the model runs: cpu, or cuda (the triton attention backend).",
               choices=("cpu", "cuda")),
    EngineFlag("max_model_len", "--max-model-len", "Longest prompt plus output in tokens (unset: the model's "
               "trained context; beyond it needs --allow-long-context).", type=int),
    EngineFlag("allow_long_context", "--allow-long-context", "Allow --max-model-len beyond the model's trained "
               "context (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN); quality past it is not guaranteed.", boolean=True),
    EngineFlag("kv_cache_memory", "--kv-cache-memory", "KV cache pool size, e.g. 2GiB (unset: "
               "--gpu-memory-utilization of the free memory).", type=parse_memory, metavar="SIZE"),
    EngineFlag("kv_cache_memory_fraction", "--gpu-memory-utilization", "Fraction of free memory the KV cache pool "
               "may take when --kv-cache-memory is unset (vLLM's name; on CPU, of free host memory and at most "
               "4 GiB; on CUDA, of the GPU's free memory).", type=float,
               metavar="FRACTION"),
    EngineFlag("block_size", "--block-size", "Tokens per KV cache block (a power of two).", type=int),
    EngineFlag("max_num_seqs", "--max-num-seqs", "Most sequences in one engine step (the batch size).", type=int),
    EngineFlag("max_num_batched_tokens", "--max-num-batched-tokens", "Token budget of one engine step (prefill "
               "chunks plus decodes).", type=int),
    EngineFlag("enable_prefix_caching", "--enable-prefix-caching", "Reuse the KV blocks of prompt prefixes seen "
               "before.", boolean=True),
    EngineFlag("quantization", "--quantization", "Weight quantization at load: int8 / int4 weight-only, w8a8 (int8 "
               "weights and activations), gguf (compute from a .gguf file's own blocks: "
               "Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and the K-quants).",
               choices=QUANTIZATION_METHODS),
    EngineFlag("quantize_lm_head", "--quantize-lm-head", "Quantize the lm_head (output projection) too.",
               boolean=True),
    EngineFlag("quant_group_size", "--quant-group-size", "Weights per scale and zero point in --quantization int4.",
               type=int, choices=INT4_GROUP_SIZES),
    EngineFlag("kv_cache_dtype", "--kv-cache-dtype", "KV cache elements: auto (the model dtype), int8 or fp8 (one "
               "byte plus a scale per token and KV head; CPU backends, not the Triton one).", choices=KV_CACHE_DTYPES),
    EngineFlag("sparsity", "--sparsity", "2:4 keeps the 2 largest of each 4 weights of the linear layers (saves "
               "memory only with --quantization none).", choices=SPARSITY_PATTERNS),
    EngineFlag("swap_space", "--swap-space", "GiB of host memory for the host KV tier that preempted sequences are "
               "swapped to.", type=float),
    EngineFlag("preemption_mode", "--preemption-mode", "How a preempted sequence gets its KV back (auto: swap when "
               "cheaper; swap needs --swap-space).", choices=("recompute", "swap", "auto")),
    EngineFlag("speculative_method", "--speculative-method", "Speculative decoding: ngram (prompt lookup, no extra "
               "model) or draft (--draft-model); unset: off.", choices=("ngram", "draft")),
    EngineFlag("num_speculative_tokens", "--num-speculative-tokens", "Most tokens proposed per step (k).", type=int),
    EngineFlag("speculative_adaptive", "--speculative-adaptive", "Pick 0..k proposals per step from measured "
               "acceptance and step costs (off: always k).", boolean=True),
    EngineFlag("draft_model", "--draft-model", "Draft model for --speculative-method draft: a path, or self (the "
               "target, quantized)."),
    EngineFlag("draft_quantization", "--draft-quantization", "Weight quantization of the draft model.",
               choices=QUANTIZATION_METHODS),
    EngineFlag("seed", "--seed", "Random seed of the engine and of sampling (same seed, same tokens).", type=int),
    EngineFlag("num_threads", "--num-threads", "Torch intra-op threads (unset: torch's default).", type=int),
    EngineFlag("attention_backend", "--attention-backend", "Attention kernels: torch, triton, or auto (triton on "
               "CUDA, torch on CPU).", choices=("auto", "torch", "triton")),
    EngineFlag("enforce_eager", "--enforce-eager", "vLLM's flag: run the model step module by module (default: a "
               "llama model on the CPU kernels runs its whole decoder stack as one native call; on CUDA, decode "
               "steps replay CUDA graphs captured per batch-size bucket).", boolean=True),
    EngineFlag("deterministic", "--deterministic", "Batch-invariant linears in float32 too (bf16 on CPUs with "
               "AVX-512 BF16 or AMX, and float32 on CPUs without AVX-512, have them by default): same tokens "
               "whatever the batch, prefill GEMMs 1.5-1.7x slower on AVX-512 CPUs.", boolean=True),
    EngineFlag("structured_outputs_backend", "--structured-outputs-backend", "Library that compiles JSON-schema, "
               "regex, choice and grammar constraints.", choices=("xgrammar",)),
    EngineFlag("tokenizer", "--tokenizer", "Tokenizer folder or .gguf file (unset: the model's own)."),
    EngineFlag("chat_template", "--chat-template", "Jinja chat template, as a file or the template text (unset: "
               "the model's own)."),
    EngineFlag("max_logprobs", "--max-logprobs", "Most top logprobs a request may ask for (logprobs, "
               "top_logprobs).", type=int),
)

# EngineConfig fields that are not flags: `model` is each subcommand's own argument; `extra` is
# for programmatic use only.
NOT_FLAGS = frozenset({"model", "extra"})


def _config_defaults() -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(EngineConfig)
            if f.default is not dataclasses.MISSING}


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine flags, defaults from EngineConfig, plus vLLM's names Tessera accepts or explains."""
    defaults = _config_defaults()
    g = p.add_argument_group("engine")
    for f in ENGINE_FLAGS:
        default = defaults[f.field]
        kw: dict[str, Any] = {"dest": f.field, "default": default, "help": f.help}
        if f.boolean:
            kw["action"] = argparse.BooleanOptionalAction if default else "store_true"
        else:
            if f.type is not None:
                kw["type"] = f.type
            if f.choices is not None:
                kw["choices"] = list(f.choices)
            if f.metavar is not None:
                kw["metavar"] = f.metavar
        g.add_argument(f.flag, **kw)
    g.add_argument("--trust-remote-code", action="store_true",
                   help="Accepted for vLLM compatibility: Tessera runs no code from model folders, only its "
                        "built-in architectures load.")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="Only 1: Tessera has no tensor parallelism; use --data-parallel N (tessera serve) for "
                        "N replicas.")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments from parsed flags; raises UsageError for vLLM flags Tessera lacks."""
    tp = getattr(args, "tensor_parallel_size", 1)
    if tp != 1:
        raise UsageError(f"--tensor-parallel-size {tp}: Tessera has no tensor parallelism; to use {tp} devices "
                         f"or processes run replicas with `tessera serve --data-parallel {tp}`, or drop the flag")
    if getattr(args, "trust_remote_code", False):
        logger.info("--trust-remote-code: accepted, but Tessera runs no code from model folders; only its built-in "
                    "architectures (Llama, Mistral, Qwen2, SmolLM) load")
    return {f.field: getattr(args, f.field) for f in ENGINE_FLAGS}


def engine_config(model: str, args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags describe; a value EngineConfig refuses is a UsageError."""
    kwargs = engine_kwargs(args)
    try:
        return EngineConfig(model=model, **kwargs)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
