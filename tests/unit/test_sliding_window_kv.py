"""Sliding-window models keep their KV bounded: blocks behind every layer's window are freed.

A tiny Mistral (window 256) reads a 4,200-token prompt in 256-token chunks and then decodes:
after every step the blocks in use, read off the engine's stats, stay under window + one
chunk (+ the partial blocks at both ends), the pool (which could not hold the whole context)
never preempts, the KV invariant holds, and the greedy tokens equal transformers' on the
whole context.
"""

from __future__ import annotations

import torch

from tessera.config import EngineConfig
from tessera.engine.engine import LLMEngine
from tessera.sampling import SamplingParams
from tests.reference import hf_greedy
from tests.tiny_model import make_tiny_model_dir

WINDOW, CHUNK, BLOCK = 256, 256, 16
PROMPT_LEN, NEW_TOKENS = 4200, 24


def test_long_run_keeps_kv_blocks_within_the_window(tmp_path):
    import transformers

    path = make_tiny_model_dir(tmp_path, model_type="mistral", sliding_window=WINDOW, max_position_embeddings=8192,
                               num_layers=2, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1)
    bytes_per_block = BLOCK * 2 * 2 * 16 * 4  # 2 layers x (K, V) x 1 head x head_dim 16 x fp32
    num_blocks = 64  # the whole prompt alone would need 263 blocks
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=BLOCK,
                                    kv_cache_memory=num_blocks * bytes_per_block, max_num_batched_tokens=CHUNK,
                                    enable_prefix_caching=True, max_model_len=8192))
    assert engine.kv.num_usable_blocks * BLOCK < PROMPT_LEN  # the bound is what makes it fit
    prompt = torch.randint(0, 250, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("long", prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    bound = -(-(WINDOW + CHUNK) // BLOCK) + 2
    peak, outputs = 0, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs = out.outputs[0].token_ids
        stats = engine.stats()
        peak = max(peak, stats.num_total_blocks - stats.num_free_blocks)
        engine.kv.check_invariants(engine.scheduler.running)
    print(f"peak {peak} blocks in use of {engine.kv.num_usable_blocks}, bound {bound}")
    assert 0 < peak <= bound, (peak, bound)
    assert engine.stats().num_preemptions == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert outputs == hf_greedy(hf, prompt, NEW_TOKENS)
