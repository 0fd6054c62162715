"""A tiny, random, complete Hugging Face model folder for tests, written in well under a second.

`make_tiny_model_dir(tmp_path, **overrides)` writes config.json, generation_config.json,
model.safetensors (seeded random weights, saved by transformers itself) and a self-contained
byte-level BPE tokenizer with a ChatML chat template. Both `transformers.AutoTokenizer` and
`transformers.AutoModelForCausalLM` load the folder, so it doubles as the reference model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# A few merges so that words become multi-byte tokens, as in a real vocabulary.
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "w")]


def build_tokenizer():
    """A byte-level BPE tokenizer: 256 byte tokens, the merges above, then the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def make_tiny_model_dir(
    tmp_path: Path,
    *,
    model_type: str = "llama",
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 512,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    sliding_window: int | None = None,
) -> Path:
    """Write a tiny random Llama (or Qwen2, with q/k/v biases, Mistral with `sliding_window`, or
    Gemma 3 with local and global layers) folder into `tmp_path`; return it.

    num_kv_heads picks MHA (= num_heads), GQA or MQA (1). rope_scaling is an HF dict, e.g.
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64}.
    """
    import transformers

    tmp_path = Path(tmp_path)
    tmp_path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    common = dict(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
    )
    rope = {"rope_theta": rope_theta, **(rope_scaling or {"rope_type": "default"})}
    if model_type == "llama":
        config = transformers.LlamaConfig(**common, head_dim=head_dim, rope_parameters=rope)
        model_class = transformers.LlamaForCausalLM
    elif model_type == "qwen2":
        if head_dim * num_heads != hidden_size:
            raise ValueError("Qwen2 needs head_dim * num_heads == hidden_size")
        config = transformers.Qwen2Config(**common, rope_parameters=rope)
        model_class = transformers.Qwen2ForCausalLM
    elif model_type == "mistral":  # Llama with a sliding window on every layer
        config = transformers.MistralConfig(**common, head_dim=head_dim, rope_parameters=rope,
                                            sliding_window=sliding_window)
        model_class = transformers.MistralForCausalLM
    elif model_type == "gemma3":  # local layers (window `sliding_window`, default 8) around one global one
        window = sliding_window or 8
        config = transformers.Gemma3TextConfig(
            **common, head_dim=head_dim, sliding_window=window, query_pre_attn_scalar=head_dim + 8,
            layer_types=["sliding_attention" if i % 3 != 1 else "full_attention" for i in range(num_layers)],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": rope_theta}})
        model_class = transformers.Gemma3ForCausalLM
    else:
        raise ValueError(f"model_type {model_type!r}: choose llama, qwen2, mistral or gemma3")

    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        # transformers initializes norms to 1 and biases to 0; random values make a loader that
        # swaps two norms, or drops a bias, fail the comparison tests.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.to(dtype).save_pretrained(tmp_path)

    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_position_embeddings,
        "chat_template": CHATML_TEMPLATE,
    }, indent=2))
    return tmp_path


# --- GGUF: the tiny model written the way llama.cpp's convert_hf_to_gguf.py writes it ---------

_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def llama_cpp_permute(w, n_head: int):
    """llama.cpp's converter (LlamaModel.permute): reorders q/k rows for its rope layout."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensor_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[module]}.{kind}"


def write_gguf_from_hf_dir(model_dir: Path, path: Path, qtype=None, extra_tensors: dict | None = None,
                           architecture: str | None = None, qtypes: dict | None = None) -> Path:
    """Convert a (tiny) HF folder to a GGUF file: metadata, tokenizer, and tensors, 2-D weights in
    `qtype` (a gguf.GGMLQuantizationType, default F32; norms and biases stay F32, as llama.cpp
    keeps them), or in qtypes[HF name] where given (the default model's file: layers Q4_1, the
    embedding Q8_0). llama-architecture q/k rows are permuted as llama.cpp does; qwen2 ones are not.
    """
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    qtype = qtype if qtype is not None else gguf.GGMLQuantizationType.F32
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    arch = architecture or {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}[hf["model_type"]]
    n_head, n_kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_head
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(hf["model_type"])
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_vocab_size(hf["vocab_size"])

    tok = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    vocab = {t: i for t, i in tok["model"]["vocab"].items()}
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(hf["bos_token_id"])
    w.add_eos_token_id(hf["eos_token_id"])
    w.add_add_bos_token(False)
    tok_config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    if tok_config.get("chat_template"):
        w.add_chat_template(tok_config["chat_template"])

    tensors = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(file))
    for name, t in tensors.items():
        t = t.astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            t = llama_cpp_permute(t, n_head)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            t = llama_cpp_permute(t, n_kv)
        kind = (qtypes or {}).get(name, qtype)
        if t.ndim == 2 and kind != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_tensor_name(name), gguf.quants.quantize(t, kind), raw_dtype=kind)
        else:
            w.add_tensor(gguf_tensor_name(name), t)
    for name, t in (extra_tensors or {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
