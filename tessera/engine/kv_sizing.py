"""How many KV blocks the pool gets: from the memory budget, never more than can be used."""

from __future__ import annotations

import logging

import torch

from tessera.config import EngineConfig, ModelConfig
from tessera.quant.kv import kv_bytes_per_token

logger = logging.getLogger("tessera")

# Without --kv-cache-memory the pool takes a fraction of available memory, on a CPU at most this
# much: a CPU host shares its RAM with everything else, and an unbounded default surprises people.
DEFAULT_KV_CAP_BYTES = 4 << 30


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def num_kv_blocks(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype, max_model_len: int) -> int:
    """Blocks in the pool, block 0 (the padding block) included."""
    # int8/fp8 KV (--kv-cache-dtype) counts its 1-byte codes and per-(token, head) scales.
    block_bytes = config.block_size * kv_bytes_per_token(mc, dtype, config.kv_cache_dtype)
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
    else:
        if config.device.startswith("cuda"):  # the GPU's free memory is the pool's alone: no cap
            budget = int(torch.cuda.mem_get_info(torch.device(config.device))[0] * config.kv_cache_memory_fraction)
        else:
            budget = min(int(available_memory_bytes() * config.kv_cache_memory_fraction), DEFAULT_KV_CAP_BYTES)
    by_budget = budget // block_bytes
    # More blocks than max_num_seqs full-length sequences can ever hold would only waste memory.
    by_use = -(-config.max_num_seqs * max_model_len // config.block_size)
    usable = min(by_budget, by_use)
    if usable < 1:
        raise ValueError(
            f"--kv-cache-memory {budget} bytes holds no KV block ({block_bytes} bytes per block of "
            f"{config.block_size} tokens); raise --kv-cache-memory"
        )
    return usable + 1
