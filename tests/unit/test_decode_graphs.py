"""The decode graphs' padded forward (tessera/engine/cuda_graphs.py) and the engine's Triton path.

CI has no GPU: the Triton kernels run in the interpreter on CPU tensors (this module sets
TRITON_INTERPRET=1 before triton is first imported, as test_triton_attention.py does), and the
graph runner runs its padded forward without capturing (`capture=False`). What a CUDA graph adds
on top, capture and replay, is checked on a GPU by benchmarks/gpu/engine_check.py. On a machine
with CUDA this module runs on the GPU and captures for real.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_mode import gpu_or_interpreter

ON_GPU = gpu_or_interpreter()  # before triton is first imported

from tessera import LLM, SamplingParams  # noqa: E402
from tessera.attention.triton_gpu import kernels_interpreted  # noqa: E402
from tessera.engine.cuda_graphs import capture_sizes  # noqa: E402

if not ON_GPU and not kernels_interpreted():
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set; run this file on its own",
                allow_module_level=True)

DEVICE = "cuda" if ON_GPU else "cpu"
# Six prompts of different lengths and output budgets: the batch shrinks 6 -> 5 -> ... -> 1 as
# they finish, so most steps are padded up to a capture size (1, 2, 4, 6).
PROMPTS = [[3 + i, 7, 11 + 2 * i, 5] * (i + 1) for i in range(6)]
MAX_TOKENS = [4, 6, 9, 12, 14, 16]


def _engine(model_dir, backend: str, enforce_eager: bool = True, device: str = DEVICE, **features) -> LLM:
    return LLM(str(model_dir), dtype="float32", device=device, attention_backend=backend, max_model_len=96,
               max_num_seqs=6, enforce_eager=enforce_eager, num_threads=1, **features)


def _greedy(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(10_000)[-1] == 256


@pytest.fixture(scope="module")
def reference_tokens(tiny_model_dir) -> list[list[int]]:
    """Greedy tokens from the torch attention backend on the CPU, the one compared with transformers."""
    return _greedy(_engine(tiny_model_dir, "torch", device="cpu"))


def test_engine_on_triton_backend_matches_torch_backend(tiny_model_dir, reference_tokens):
    assert _greedy(_engine(tiny_model_dir, "triton")) == reference_tokens


def test_padded_decode_graphs_match_eager(tiny_model_dir, reference_tokens):
    llm = _engine(tiny_model_dir, "triton", enforce_eager=False)  # on a GPU the engine captures its graphs
    runner = llm.engine.runner
    if runner.decode_graphs is None:  # on CPU the engine never captures: build the padded runner here
        runner.capture_decode_graphs(llm.engine.max_model_len, 6, capture=ON_GPU)
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 6]
    replayed = []
    original = graphs.run

    def counting_run(input_ids, positions, metadata):
        logits = original(input_ids, positions, metadata)
        if logits is not None:
            replayed.append(metadata.num_decode_tokens)
        return logits

    graphs.run = counting_run
    assert _greedy(llm) == reference_tokens
    # Every step after the prompts' was a decode the graphs ran, padded where the batch is no
    # capture size (5 rows in the bucket of 6, 3 in that of 4).
    assert len(replayed) >= max(MAX_TOKENS) - 1
    assert {5, 3} <= set(replayed)


# Engine features whose steps mix with the graphs' decode steps; each keeps greedy tokens.
FEATURES = {
    "chunked prefill": dict(max_num_batched_tokens=16),  # prompts in chunks, next to padded decodes
    "preemption": dict(kv_cache_memory=8 * 16 * 512, swap_space=0),  # 7 usable blocks for ~12 blocks of work
    "ngram speculation": dict(speculative_method="ngram", num_speculative_tokens=3),
}


@pytest.mark.parametrize("feature", FEATURES)
def test_decode_graphs_with_engine_features(tiny_model_dir, reference_tokens, feature):
    """The graphs' decode steps between chunked prefills, after preemptions (recomputed prompts)
    and around speculative steps (which run eagerly): the reference's tokens all the same."""
    llm = _engine(tiny_model_dir, "triton", enforce_eager=False, **FEATURES[feature])
    runner = llm.engine.runner
    if runner.decode_graphs is None:
        runner.capture_decode_graphs(llm.engine.max_model_len, 6, capture=ON_GPU)
    replayed = []
    original = runner.decode_graphs.run

    def counting_run(*args):
        logits = original(*args)
        replayed.append(logits is not None)
        return logits

    runner.decode_graphs.run = counting_run
    assert _greedy(llm) == reference_tokens
    assert any(replayed)  # the graphs took part
    if feature == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0


def test_padding_rows_write_no_kv(tiny_model_dir):
    """Three sequences in the bucket of four: the padding row writes nowhere, so every slot but
    the three new tokens' is unchanged (block 0, the padding target, included)."""
    llm = _engine(tiny_model_dir, "triton")
    runner = llm.engine.runner
    runner.capture_decode_graphs(llm.engine.max_model_len, 6, capture=ON_GPU)
    device = runner.device
    bs = runner.block_size
    tables = torch.tensor([[1, 2], [3, 0], [4, 5]])
    lens = torch.tensor([20, 9, 17])
    slots = torch.stack([tables[i, (n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(lens.tolist())])
    from tessera.attention.metadata import AttentionMetadata

    ctx = int(lens.max())
    all_slots = (tables.unsqueeze(-1) * bs + torch.arange(bs)).view(3, -1)[:, :ctx]
    metadata = AttentionMetadata(slot_mapping=slots, num_decode_tokens=3, decode_slots=all_slots,
                                 decode_mask=(torch.arange(ctx) < lens[:, None]).view(3, 1, 1, ctx), prefills=[],
                                 block_size=bs, decode_block_tables=tables, decode_context_lens=lens)
    for k, v in runner.kv_caches:  # a recognisable, finite cache
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    with torch.inference_mode():
        logits = runner.decode_graphs.run(torch.tensor([5, 6, 7]), lens - 1, metadata)
    assert logits is not None and logits.shape == (3, llm.engine.model_config.vocab_size)
    assert torch.isfinite(logits).all()
    written = slots.to(device)
    for (k0, v0), (k1, v1) in zip(before, runner.kv_caches, strict=True):
        keep = torch.ones(k0.shape[0], dtype=torch.bool, device=device)
        keep[written] = False
        assert torch.equal(k0[keep], k1[keep]) and torch.equal(v0[keep], v1[keep])
        assert not torch.equal(k0[written], k1[written])
    # The same step without padding, through the model directly: the same logits.
    with torch.inference_mode():
        hidden = runner.model(torch.tensor([5, 6, 7], device=device), (lens - 1).to(device), runner.kv_caches,
                              metadata.to(device))
        direct = runner.model.compute_logits(hidden)
    torch.testing.assert_close(logits, direct, rtol=1e-4, atol=1e-4)
