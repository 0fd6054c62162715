"""A GGUF model in bf16 decodes from the file's blocks (tessera/quant/gguf_codes.py): the blocks in
tile order hold the file's weight bit for bit, the codes kernel gives the bf16 kernel's output bit
for bit at every row count, and an engine with them gives the same tokens and logprobs as one
without, through the native stack and the module path."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from tessera import SamplingParams, kernels
from tessera.config import EngineConfig
from tessera.engine.engine import LLMEngine
from tessera.kernels.linear import InvariantLinear
from tessera.quant import gguf_codes, invariant
from tessera.quant.gguf_tiles import KIND, KQTiles
from tests.tiny_model import write_gguf_from_hf_dir
from tests.unit.test_gguf_kquant import expected_bytes, random_blocks

needs_codes = pytest.mark.skipif(
    not (kernels.available() and invariant.available()),
    reason="the codes path runs on AVX-512 BF16 CPUs (AMX or not), where both kernels take one arithmetic")
needs_amx = pytest.mark.skipif(not (kernels.available() and invariant.available() and invariant.cpu_has_amx()),
                               reason="gguf mode computes Q4_0/Q4_1 from the KQ blocks on AMX only")


@pytest.mark.parametrize("qtype", gguf_codes.TYPES)
def test_tiles_hold_the_files_weight_bit_for_bit(qtype):
    raw = random_blocks(qtype, 70, 256, seed=11)
    tiles = KQTiles.pack(torch.from_numpy(raw.copy()), qtype)
    want = gguf.quants.dequantize(raw, qtype)
    ids = torch.arange(70)
    assert np.array_equal(tiles.rows(ids, 256, qtype).numpy().view(np.uint32), want.view(np.uint32))
    # the file's bytes, nothing more: rows padded to 32 (Q4_K / Q5_K keep their 12 bytes of 6-bit
    # scales and mins in 16, as the kernel reads them)
    assert tiles.nbytes() == expected_bytes(qtype, 70, 256, tiled=True)


@needs_codes
@pytest.mark.parametrize("qtype", gguf_codes.TYPES)
def test_codes_give_the_bf16_kernels_bits_at_every_row_count(qtype):
    raw = random_blocks(qtype, 96, 512, seed=12)
    w = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    plain, coded = InvariantLinear(w.bfloat16()), InvariantLinear(w.bfloat16())
    # Without AMX every call from the blocks (the direct path up to 8 rows, four blocks at a time up
    # to 4 and two above; the whole-K path above 8); on AMX the calls the engine sends them (up to 32
    # rows), the larger ones the bf16 weight.
    limit = gguf_codes.max_rows() if invariant.cpu_has_amx() else 100
    coded.attach_codes(KQTiles.pack(torch.from_numpy(raw.copy()), qtype), KIND[qtype], limit)
    gen = torch.Generator().manual_seed(13)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 32, 33, 100):
        x = torch.randn(m, 512, generator=gen).bfloat16()
        want = plain(x)
        assert torch.equal(coded(x), want), f"{m} rows"
        # and the bf16 kernel is the float64 product to bf16 precision
        ref = F.linear(x.double(), w.bfloat16().double())
        assert ((want.double() - ref).abs() <= 2**-7 * (x.double().abs() @ w.double().abs().t()) + 1e-6).all()
    bias = torch.randn(96, generator=gen).bfloat16()
    x = torch.randn(4, 512, generator=gen).bfloat16()
    assert torch.equal(coded(x, bias), plain(x, bias))  # a bias takes the bf16 weight


@needs_codes
def test_the_codes_are_what_small_calls_read():
    """Codes of another weight change the output of calls up to the CPU's row limit and of no larger
    one: the engine tests below are not passing because the codes go unused."""
    raw, other = random_blocks(Q.Q4_1, 64, 256, seed=14), random_blocks(Q.Q4_1, 64, 256, seed=15)
    layer = InvariantLinear(torch.from_numpy(gguf.quants.dequantize(raw, Q.Q4_1)).bfloat16())
    rows = gguf_codes.max_rows()
    small, large = torch.randn(rows, 256).bfloat16(), torch.randn(rows + 1, 256).bfloat16()
    before = layer(small), layer(large)
    layer.attach_codes(KQTiles.pack(torch.from_numpy(other.copy()), Q.Q4_1), KIND[Q.Q4_1], rows)
    assert not torch.equal(layer(small), before[0])
    assert torch.equal(layer(large), before[1])


def test_codes_serve_bf16_weights_only():
    if not (kernels.available() and kernels.cpu_has_avx512_bf16()):
        pytest.skip("needs the float32 InvariantLinear's kernels")
    layer = InvariantLinear(torch.randn(32, 64))
    with pytest.raises(ValueError, match="bf16 weights"):
        layer.attach_codes(KQTiles.pack(torch.from_numpy(random_blocks(Q.Q4_0, 32, 64)), Q.Q4_0), KIND[Q.Q4_0], 4)


PROMPTS = [list(range(5, 45)), list(range(7, 12)), [3] * 60 + list(range(20, 50))]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)


def _generate(engine: LLMEngine, tag: str) -> dict:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"{tag}{i}", prompt, GREEDY)
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id.removeprefix(tag)] = (o.outputs[0].token_ids, o.outputs[0].logprobs)
    return out


def _generate_by_mode(path, dtype: str, check_gguf) -> dict:
    """_generate's outputs of an engine on the GGUF file `path` under --quantization none and then
    gguf (prefix caching off; a 32-token budget puts prefill chunks beside decodes);
    check_gguf(model) runs on the gguf engine's model before it generates."""
    outs = {}
    for mode in ("none", "gguf"):
        engine = LLMEngine(EngineConfig(model=str(path), dtype=dtype, quantization=mode, max_model_len=256,
                                        max_num_batched_tokens=32, enable_prefix_caching=False))
        if mode == "gguf":
            check_gguf(engine.runner.model)
        outs[mode] = _generate(engine, mode)
    return outs


def _coded(model) -> list[InvariantLinear]:
    return [m for m in model.modules()
            if isinstance(m, InvariantLinear) and (m.codes is not None or m.q8_codes is not None)]


@needs_codes
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_0])
@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("lm_head", [None, "tied", "own"], ids=["lm_head-q4", "tied-q8_0", "own-q8_0"])
def test_engine_with_codes_equals_engine_without(tiny_model_factory, tmp_path, caplog, qtype, eager, lm_head):
    """One engine, the same requests with the codes and then without them (the same engine, so
    nothing but the linears' weights source differs; prefix caching off, so both compute every
    token). A small token budget puts prefill chunks (bf16 weights above the row limit) next to
    decodes. With a Q8_0 lm_head, tied to the embedding (the default model's file) or its own, it
    reads its blocks too, and on AMX greedy ids come from its store epilogue (a vocabulary of 267:
    padded tiles)."""
    from tessera.model.native_stack import NativeStack

    model_dir = tiny_model_factory(tie_word_embeddings=lm_head == "tied")
    source = "model.embed_tokens.weight" if lm_head == "tied" else "lm_head.weight"
    path = write_gguf_from_hf_dir(model_dir, tmp_path / "t.gguf", qtype=qtype,
                                  qtypes={source: Q.Q8_0} if lm_head else None)
    with caplog.at_level(logging.INFO, logger="tessera"):
        engine = LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", enforce_eager=eager, max_model_len=256,
                                        max_num_batched_tokens=32, enable_prefix_caching=False))
    assert "from the GGUF blocks" in caplog.text
    model = engine.runner.model
    assert model.config.tie_word_embeddings == (lm_head == "tied")
    coded = _coded(model)
    # qkv, o, gate_up, down; the lm_head only from Q8_0 blocks (a Q4 one keeps its bf16 weight)
    assert len(coded) == 4 * model.config.num_layers + (lm_head is not None)
    assert (model.lm_head.q8_codes is not None) == (lm_head is not None)
    assert (model.native_stack is None) == eager
    got = _generate(engine, "a")
    for m in coded:
        m.codes = m.q8_codes = None
    if not eager:
        model.native_stack = NativeStack.build(model)  # its linears now kind 0 (bf16) again
    assert not _coded(model)
    assert _generate(engine, "b") == got


@needs_codes
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
@pytest.mark.parametrize("eager", [False, True])
def test_kquant_codes_give_the_engine_its_bf16_tokens(tiny_model_factory, tmp_path, monkeypatch, qtype, eager):
    """Q4_K_M files' K-quant layers (sub-block scales: the stacks' fifth tensor slot) read their
    blocks too, with the same tokens and logprobs as their bf16 weights. gguf-py cannot quantize to
    K-quants, so the file holds random blocks of the right shapes (hidden 256 and intermediate 512:
    rows of whole 256-weight super-blocks)."""
    from tessera.model.native_stack import NativeStack

    quantize = gguf.quants.quantize
    blocks = iter(range(1000))

    def random_kquant(t, kind):
        if kind != qtype:
            return quantize(t, kind)
        return random_blocks(kind, t.shape[0], t.shape[1], seed=next(blocks))

    monkeypatch.setattr(gguf.quants, "quantize", random_kquant)
    model_dir = tiny_model_factory(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64)
    path = write_gguf_from_hf_dir(model_dir, tmp_path / "t.gguf", qtype=qtype)
    monkeypatch.undo()
    engine = LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", enforce_eager=eager, max_model_len=256,
                                    max_num_batched_tokens=32, enable_prefix_caching=False))
    model = engine.runner.model
    coded = _coded(model)
    assert len(coded) == 4 * model.config.num_layers and all(m.codes.sub is not None for m in coded)
    assert (model.native_stack is None) == eager
    got = _generate(engine, "a")
    for m in coded:
        m.codes = None
    if not eager:
        model.native_stack = NativeStack.build(model)
    assert _generate(engine, "b") == got


@needs_codes
def test_the_decoder_stack_reads_the_codes_up_to_the_row_limit(tiny_model_factory, tmp_path):
    """The native stack's kind-4 linears carry their row limit in their format: with layer 0's o_proj
    given another weight's blocks, a one-sequence decode step changes (it reads them) and a prefill
    longer than the limit does not (its first token and logprobs are the bf16 weight's)."""
    from tessera.model.native_stack import NativeStack

    path = write_gguf_from_hf_dir(tiny_model_factory(), tmp_path / "t.gguf", qtype=Q.Q4_1)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", max_model_len=256,
                                    enable_prefix_caching=False))
    model = engine.runner.model
    assert model.native_stack is not None
    prompt = list(range(5, 45))  # 40 tokens: above the limit on every CPU
    assert len(prompt) > gguf_codes.max_rows()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)

    def run(tag: str):
        engine.add_request(tag, prompt, params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    return o.outputs[0].token_ids, o.outputs[0].logprobs

    ids, logprobs = run("a")
    o_proj = model.layers[0].self_attn.o_proj
    n, k = o_proj.out_features, o_proj.in_features
    o_proj.codes = KQTiles.pack(torch.from_numpy(random_blocks(Q.Q4_1, n, k, seed=21)), Q.Q4_1)
    model.native_stack = NativeStack.build(model)
    other_ids, other_logprobs = run("b")
    assert other_ids[0] == ids[0] and other_logprobs[0] == logprobs[0]  # the prefill: bf16 weights
    assert other_logprobs[1:] != logprobs[1:]  # the decode steps: the other blocks


def test_no_codes_when_turned_off(tiny_model_factory, tmp_path, monkeypatch):
    path = write_gguf_from_hf_dir(tiny_model_factory(), tmp_path / "t.gguf", qtype=Q.Q4_1)
    monkeypatch.setenv("TESSERA_GGUF_CODES", "0")
    engine = LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", max_model_len=256))
    assert not _coded(engine.runner.model)


@needs_amx
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_0])
def test_gguf_mode_gives_the_bf16_engines_tokens(tiny_model_factory, tmp_path, qtype):
    """On AMX, --quantization gguf computes Q4_0/Q4_1 layers and a Q8_0 lm_head as the bf16 engine
    rounds them (W the file's float32 dequantization, then bf16), so the two modes give the same
    tokens and logprobs: the gguf one from the blocks alone, the other from bf16 copies and blocks."""
    from tessera.quant.gguf_kquant import GGUFBlockLinear

    path = write_gguf_from_hf_dir(tiny_model_factory(tie_word_embeddings=True), tmp_path / "t.gguf", qtype=qtype,
                                  qtypes={"model.embed_tokens.weight": Q.Q8_0})

    def check(model) -> None:
        layers = [m for m in model.modules() if isinstance(m, GGUFBlockLinear)]
        assert len(layers) == 4 * model.config.num_layers

    outs = _generate_by_mode(path, "bfloat16", check)
    assert outs["gguf"] == outs["none"]
