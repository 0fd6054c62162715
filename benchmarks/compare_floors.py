"""The floors benchmarks/compare.py prints next to every engine's figures: what this machine
allows for the same work, counted as benchmarks/roofline.py counts a step (its `count_step`,
`measure_matmul`, `measure_bandwidth`), with the weight bytes of the format the engine reads.

- decode at batch 1: the bytes one token must read (weights + KV) over the measured bandwidth;
- a decode step at batch B (B = the offline run's request count): max(bytes / bandwidth,
  FLOPs / GEMM rate);
- prefill of one prompt (TTFT): its FLOPs over the measured GEMM rate (the fraction of that rate
  the engine reaches is printed too);
- the offline run: every prompt's prefill at the GEMM rate, then output_len - 1 decode steps at
  batch B with the context growing, each at its own floor.

The compute roof is the dtype's dense GEMM rate through torch (oneDNN; bf16 on AMX where the CPU
has it) for every engine, quantized ones included: a 4-bit engine dequantizes into that rate or
below it, so it is a floor for them too. Runs in Tessera's venv (torch, gguf).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import count_step, measure_bandwidth, measure_matmul  # noqa: E402

from tessera.config import ModelConfig  # noqa: E402


def measure_machine(dtype: torch.dtype, threads: int) -> dict:
    """This machine's GEMM rate (2048^3, best of 5) in `dtype` and memory bandwidth (1 GiB copy
    and sum, best of 5) on `threads` torch threads, the roofs of every floor below."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rate = measure_matmul(dtype, 2048, 5)
        bw = measure_bandwidth(1024, 5)
    finally:
        torch.set_num_threads(before)
    return {"gemm_flops": rate, "gemm_dtype": str(dtype).removeprefix("torch."), "threads": threads,
            "copy_bytes_per_s": bw["copy"], "read_bytes_per_s": bw["read"],
            "bandwidth": max(bw["copy"], bw["read"]), "load_average_1min": os.getloadavg()[0]}


def gguf_weight_bytes(path: str) -> int:
    """Bytes a decode step reads from this GGUF's tensors: all of them, except the embedding
    table when the file has an output matrix of its own (then only a few embedding rows are
    gathered; when tied, the table is the lm_head and is read whole)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def bf16_codes_saving(path: str) -> int:
    """Bytes a Tessera bf16 decode step does not read on this machine because it computes its layer
    weights from the GGUF file's blocks (tessera/quant/gguf_codes.py: Q4_0/Q4_1/Q5_0/Q5_1 tensors,
    AVX-512 BF16 CPUs, unless TESSERA_GGUF_CODES=0), and its lm_head from Q8_0 blocks (output.weight,
    or token_embd.weight when tied): per such tensor its bf16 bytes less its file bytes. 0 where the
    engine reads bf16 (another file type, no AVX-512 BF16), so its floor is the bytes it reads."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFReader

    from tessera.quant import gguf_codes

    if not str(path).endswith(".gguf") or not gguf_codes.enabled():
        return 0
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    saving = sum(int(t.n_elements) * 2 - int(t.n_bytes) for name, t in tensors.items()
                 if name.startswith("blk.") and t.tensor_type in gguf_codes.TYPES)
    lm_head = tensors.get("output.weight", tensors.get("token_embd.weight"))
    if lm_head is not None and lm_head.tensor_type == Q.Q8_0:
        saving += int(lm_head.n_elements) * 2 - int(lm_head.n_bytes)
    return saving


def f32_blocks_saving(path: str) -> int:
    """Bytes a Tessera float32 decode step at batch 1 does not read on this machine because it
    computes its linears from the GGUF file's blocks (tessera/quant/gguf_f32_blocks.py: AVX2 CPUs
    without AVX-512, calls of up to BLOCKS_MAX_ROWS rows, unless TESSERA_GGUF_CODES=0): per such
    tensor its float32 bytes less the bytes of its blocks in the kernel's layout (BLOCK_BYTES: the
    file's for Q4_0 / Q4_1 / Q8_0, more for Q5_0, Q4_K and Q6_K), the lm_head's (output.weight, or
    token_embd.weight when tied) included. 0 where it reads float32."""
    from gguf import GGUFReader

    from tessera.quant import gguf_f32_blocks

    if not str(path).endswith(".gguf") or not gguf_f32_blocks.enabled():
        return 0
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    lm_head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    return sum(int(t.n_elements) * 4 - int(t.n_elements) // 32 * gguf_f32_blocks.BLOCK_BYTES[t.tensor_type]
               for name, t in tensors.items()
               if (name.startswith("blk.") or name == lm_head) and t.tensor_type in gguf_f32_blocks.FORMAT)


def _step(cfg: ModelConfig, tokens: int, contexts: list[tuple[int, int]], logit_rows: int, elem: int,
          weight_bytes: int | None) -> dict:
    c = count_step(cfg, tokens, contexts, logit_rows, elem, elem)
    if weight_bytes is not None:  # a quantized format: its own bytes instead of numel * elem
        c["bytes"] += weight_bytes - c["weight_bytes"]
        c["weight_bytes"] = weight_bytes
    return c


def _floor(c: dict, m: dict) -> float:
    return max(c["flops"] / m["gemm_flops"], c["bytes"] / m["bandwidth"])


def floors(cfg: ModelConfig, m: dict, input_len: int, output_len: int, batch: int, elem: int = 2,
           weight_bytes: int | None = None, b1_weight_bytes: int | None = None) -> dict:
    """Seconds each of compare.py's figures cannot go below on machine `m` (see the docstring).
    `elem`: bytes per weight and KV element of a float format; `weight_bytes`: a quantized file's;
    `b1_weight_bytes`: what a batch-1 step reads where that differs (float32 Tessera's blocks)."""
    mid = input_len + output_len // 2
    d1 = _step(cfg, 1, [(1, mid)], 1, elem, b1_weight_bytes or weight_bytes)
    db = _step(cfg, batch, [(1, mid)] * batch, batch, elem, weight_bytes)
    pre = _step(cfg, input_len, [(input_len, input_len)], 1, elem, weight_bytes)
    offline = batch * pre["flops"] / m["gemm_flops"]  # the prompts' matmuls, at the GEMM rate
    for k in range(1, output_len):
        offline += _floor(_step(cfg, batch, [(1, input_len + k)] * batch, batch, elem, weight_bytes), m)
    return {
        "decode_b1_s": _floor(d1, m), "decode_b1_bytes": d1["bytes"], "decode_b1_weight_bytes": d1["weight_bytes"],
        "decode_batch": batch, "decode_b_s": _floor(db, m), "decode_b_flops": db["flops"], "decode_b_bytes": db["bytes"],
        "decode_b_bound": "compute" if db["flops"] / m["gemm_flops"] >= db["bytes"] / m["bandwidth"] else "memory",
        "prefill_flops": pre["flops"], "prefill_s": _floor(pre, m), "offline_s": offline,
    }
