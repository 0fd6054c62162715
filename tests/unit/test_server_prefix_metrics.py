"""/metrics exports the prefix cache and host tier counters (vLLM-style names) after requests
served through the app: queries, hits and hit rate by tokens, blocks evicted, demoted to and
promoted from the host tier, swapped out and in. The workload is built so that every one of
them moves, and the exported values must equal the engine's own stats."""

from __future__ import annotations

import asyncio
import random

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tessera.config import EngineConfig
from tessera.server.app import create_app
from tests.unit.test_server import ServerThread

BS = 4
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, fp32


def scrape(base_url: str) -> dict[str, float]:
    """name -> value of every single-sample family (counters by their _total sample)."""
    text = httpx.get(base_url + "/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        samples = [s for s in family.samples if not s.name.endswith("_created")]
        if len(samples) == 1:
            values[samples[0].name] = samples[0].value
    return values


def test_prefix_cache_and_host_tier_counters_on_the_metrics_page(tiny_model_dir):
    # 25 device blocks of 4 tokens, a host tier of 200, swap-mode preemption.
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", block_size=BS, max_model_len=128,
                          kv_cache_memory=26 * BS * TINY_KV_BYTES_PER_TOKEN, max_num_seqs=4,
                          max_num_batched_tokens=32, swap_space=200 * BS * TINY_KV_BYTES_PER_TOKEN / (1 << 30),
                          preemption_mode="swap", num_threads=1)
    rng = random.Random(0)
    stem = [rng.randrange(200) for _ in range(32)]  # 8 full blocks
    with ServerThread(create_app(config, served_model_name="tiny")) as srv:
        client = srv.client()

        def complete(prompt: list[int], max_tokens: int) -> None:
            client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True})

        complete(stem + [1, 2], 4)  # computes the stem; its blocks stay cached when it finishes

        async def crowd() -> None:  # 4 x 64 tokens in 100 slots: preemption, swapping, eviction
            async with srv.async_client() as aclient:
                await asyncio.gather(*(
                    aclient.completions.create(model="tiny", prompt=[rng.randrange(200) for _ in range(40)],
                                               max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
                    for _ in range(4)))

        asyncio.run(crowd())
        complete(stem + [3], 4)  # the stem comes back from the host tier
        stats = srv.wait_idle()
        page = scrape(srv.base_url)

    expected = {
        "tessera:prefix_cache_queries_total": stats.prefix_cache_queries,
        "tessera:prefix_cache_hits_total": stats.prefix_cache_hits,
        "tessera:prefix_cache_hit_rate": stats.prefix_cache_hits / stats.prefix_cache_queries,
        "tessera:prefix_cache_evicted_blocks_total": stats.num_evicted_blocks,
        "tessera:prefix_cache_demoted_blocks_total": stats.num_demoted_blocks,
        "tessera:prefix_cache_promoted_blocks_total": stats.num_promoted_blocks,
        "tessera:kv_blocks_swapped_out_total": stats.num_swapped_out_blocks,
        "tessera:kv_blocks_swapped_in_total": stats.num_swapped_in_blocks,
        "tessera:num_requests_swapped": 0,
        "tessera:host_kv_cache_usage_perc": 0.0,
    }
    for name, value in expected.items():
        assert page[name] == value, (name, page[name], value)
    # The workload moved every counter; the last request hit at least the stem's 8 blocks.
    for name in expected:
        if name.endswith("_total"):
            assert page[name] > 0, name
    assert page["tessera:prefix_cache_promoted_blocks_total"] >= 1
    assert page["tessera:prefix_cache_hits_total"] >= 32
    assert page["tessera:prefix_cache_queries_total"] >= 34 + 4 * 40 + 33  # preempted ones are looked up again
