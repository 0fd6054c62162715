"""Frozen configuration objects: the model's architecture and the engine's knobs.

Every optimization is a field here, so a benchmark can A/B it and the advisor can switch it.
Derived values (KV block count, dtype) are computed once at start-up, never per step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from tessera.sampling import MAX_LOGPROBS  # the most top logprobs the sampler returns per token

DEFAULT_MODEL = "smollm2-135m-instruct"
# --quantization choices (tessera/quant) and the int4 group sizes.
QUANTIZATION_METHODS = ("none", "int8", "int4", "w8a8", "gguf")
INT4_GROUP_SIZES = (32, 64, 128)
# --kv-cache-dtype choices (tessera/quant/kv.py): the model dtype, or 1-byte codes with scales.
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
# --sparsity choices (tessera/quant/sparse.py): 2:4 prunes each group of 4 weights to 2.
SPARSITY_PATTERNS = ("none", "2:4")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyperparameters of a decoder-only model; `architecture` names its family in
    tessera.model.registry, which also says which of the optional fields each family reads."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope scaling dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...} or None.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q, k and v
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Sliding-window attention: a layer of type "sliding_attention" sees only the last
    # `sliding_window` positions (itself included). layer_types None = every layer is windowed
    # when sliding_window is set (Mistral), else every layer is global.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    hidden_act: str = "silu"  # the MLP gate's activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    # Gemma 3: the rope base of its sliding layers, the attention scale (query_pre_attn_scalar
    # ** -0.5 instead of head_dim ** -0.5) and tanh soft-capping of the final logits.
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})"
            )
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer `layer_idx` in tokens, or None for a global layer."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer_idx] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def kv_window(self) -> int | None:
        """Positions further back than this are read by no layer (their KV blocks can be freed);
        None when some layer attends to the whole context."""
        windows = [self.layer_window(i) for i in range(self.num_layers)]
        return None if any(w is None for w in windows) else max(windows)

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


@functools.cache
def cpu_has_bf16() -> bool:
    """True when the CPU runs bf16 matmuls natively (AVX-512 BF16 or AMX); else bf16 is emulated and slow."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map the --dtype flag to a torch dtype; auto picks bfloat16 only where the CPU has native bf16."""
    if isinstance(dtype, torch.dtype):
        return dtype
    choices = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype == "auto":
        if torch.cuda.is_available():
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    if dtype not in choices:
        raise ValueError(f"--dtype {dtype!r} is not supported; choose one of auto, {', '.join(choices)}")
    return choices[dtype]


@dataclass(frozen=True)
class EngineConfig:
    """What the user chose when starting the engine (flags of `tessera serve`, kwargs of `LLM`)."""

    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    # Longest prompt + output a request may have; None = the model's max_position_embeddings.
    max_model_len: int | None = None
    # KV cache: tokens per block, and the memory the pool may take (bytes). None = a fraction
    # of free memory (kv_cache_memory_fraction), capped so that a laptop run stays modest.
    block_size: int = 16
    kv_cache_memory: int | None = None
    kv_cache_memory_fraction: float = 0.3
    enable_prefix_caching: bool = True
    # Weight quantization applied at load (tessera/quant): none | int8 | int4 | w8a8 | gguf; the
    # lm_head too when quantize_lm_head; int4 groups of quant_group_size weights.
    quantization: str = "none"
    quantize_lm_head: bool = False
    quant_group_size: int = 32
    # KV cache element format: auto (the model dtype) | int8 | fp8 (one byte + a scale per token
    # and KV head); 2:4 structured sparsity of the quantized linear weights, pruned at load.
    kv_cache_dtype: str = "auto"
    sparsity: str = "none"
    # The host KV tier: GiB of host memory for a second block pool that preempted sequences are
    # swapped to (0 = none), and how a preempted sequence gets its K/V back: recompute, swap
    # (when the host pool has room), or auto (swap when measured cheaper than recompute).
    swap_space: float = 0.0
    preemption_mode: str = "auto"
    # Scheduler: the token budget of one step (prefill chunks + decodes) and the batch limit.
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    # Speculative decoding (tessera/spec): None = off; "ngram" (prompt lookup) or "draft" (a
    # smaller model with the same tokenizer, draft_model). Up to num_speculative_tokens proposals
    # per step; adaptive picks 0..k per step from measured acceptance and step costs.
    speculative_method: str | None = None
    num_speculative_tokens: int = 8
    speculative_adaptive: bool = True
    draft_model: str | None = None  # "self": the target's own weights, with draft_quantization
    draft_quantization: str = "none"
    seed: int = 0
    device: str = "cpu"
    attention_backend: str = "auto"  # see tessera.attention.backend: auto | torch | triton
    num_threads: int | None = None  # torch intra-op threads; None = leave torch's default
    # enforce_eager: vLLM's name: the model step runs module by module, op by op (off: a llama
    # model on the CPU kernels runs its decoder stack as one native call, tessera/model/native_stack.py;
    # on CUDA, decode steps replay graphs captured per batch-size bucket, tessera/engine/cuda_graphs.py).
    # deterministic: the batch-invariant linear kernels in float32 too (docs/reproducibility.md).
    enforce_eager: bool = False
    deterministic: bool = False
    # vLLM's knobs: a tokenizer other than the model's, a chat template (a file or the template
    # text), the most top logprobs a request may ask for, and max_model_len past the trained context.
    tokenizer: str | None = None
    chat_template: str | None = None
    max_logprobs: int = 20
    allow_long_context: bool = False
    # Structured outputs (tessera/structured): the library that compiles and matches grammars.
    structured_outputs_backend: str = "xgrammar"
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a positive power of two, got {self.block_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"--quantization {self.quantization!r}: choose one of {', '.join(QUANTIZATION_METHODS)}")
        if self.quant_group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"--quant-group-size {self.quant_group_size}: choose one of "
                             f"{', '.join(map(str, INT4_GROUP_SIZES))}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")
        if self.kv_cache_dtype != "auto" and self.attention_backend == "triton":
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} is implemented in the torch attention backend "
                             "only: use --attention-backend torch, or --kv-cache-dtype auto")
        if self.sparsity not in SPARSITY_PATTERNS:
            raise ValueError(f"--sparsity {self.sparsity!r}: choose one of {', '.join(SPARSITY_PATTERNS)}")
        if self.sparsity != "none" and self.quantization == "gguf":
            raise ValueError("--sparsity 2:4 prunes float weights before quantizing them; it cannot be combined "
                             "with --quantization gguf (the file's own blocks): use none, int8, int4 or w8a8")
        if self.swap_space < 0:
            raise ValueError(f"--swap-space must be >= 0 GiB, got {self.swap_space}")
        if self.speculative_method not in (None, "ngram", "draft"):
            raise ValueError(f"--speculative-method {self.speculative_method!r}: choose ngram or draft")
        if self.speculative_method is not None and self.num_speculative_tokens < 1:
            raise ValueError(f"--num-speculative-tokens must be >= 1, got {self.num_speculative_tokens}")
        if (self.speculative_method == "draft") != (self.draft_model is not None):
            raise ValueError("--speculative-method draft needs --draft-model PATH (a smaller model with the "
                             "same tokenizer), and --draft-model is used only with --speculative-method draft")
        if self.draft_quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"--draft-quantization {self.draft_quantization!r}: choose one of "
                             f"{', '.join(QUANTIZATION_METHODS)}")
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            raise ValueError(f"--preemption-mode {self.preemption_mode!r}: choose recompute, swap or auto")
        if self.structured_outputs_backend not in ("xgrammar",):
            raise ValueError(f"--structured-outputs-backend {self.structured_outputs_backend!r}: choose xgrammar")
        if self.preemption_mode == "swap" and self.swap_space == 0:
            raise ValueError("--preemption-mode swap needs a host KV pool: give --swap-space in GiB, e.g. 4")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.kv_cache_memory_fraction}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"--device {self.device!r}: choose cpu or cuda")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"--max-logprobs must be in [0, {MAX_LOGPROBS}] (the most the sampler returns), "
                             f"got {self.max_logprobs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2 (a prompt token and an output token), got "
                             f"{self.max_model_len}")
        if self.chat_template is not None:
            chat_template_text(self.chat_template)  # raises for a missing file that is no template either

    def resolve_max_model_len(self, model: ModelConfig) -> int:
        """max_model_len for `model`: the flag, else the trained context; beyond it only when allowed."""
        trained = model.max_position_embeddings
        if self.max_model_len is None:
            return trained
        if self.max_model_len > trained and not self.allow_long_context:
            raise ValueError(f"--max-model-len {self.max_model_len} is beyond the model's trained context of "
                             f"{trained} tokens: lower it, or add --allow-long-context to use it anyway (outputs "
                             f"past {trained} tokens may degrade)")
        return self.max_model_len


def chat_template_text(value: str) -> str:
    """--chat-template's Jinja text: the file it names, or the value itself when it is a template."""
    import os

    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template (no '{{{{' or '{{%')")
