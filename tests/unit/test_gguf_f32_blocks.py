"""A GGUF model in float32 decodes from the file's blocks on the AVX2 tiles (tessera/quant/
gguf_f32_blocks.py): the blocks kernel gives the float32 kernel's output on the loader's weight
(gguf.quants' dequantization) bit for bit at every row count and store, small calls read the blocks
and large ones the float32 weight, and an engine with the blocks gives the same tokens and logprobs
as one without, through the native stack and the module path. --quantization gguf's K-quant and Q5
layers keep only the blocks and compute from them at every size: a Q5_1 file's gguf-mode engine
gives the float32 engine's tokens and logprobs."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tessera import kernels
from tessera.config import EngineConfig
from tessera.engine.engine import LLMEngine
from tessera.kernels.linear import InvariantLinear, _on_avx2_tiles
from tessera.quant import gguf_f32_blocks
from tessera.quant.gguf_f32_blocks import BLOCKS_MAX_ROWS, FORMAT
from tests.tiny_model import write_gguf_from_hf_dir
from tests.unit.test_gguf_codes import _generate, _generate_by_mode
from tests.unit.test_gguf_kquant import random_blocks

needs_avx2_tiles = pytest.mark.skipif(not (kernels.available() and _on_avx2_tiles()),
                                      reason="the float32 blocks kernel is the AVX2 tiles' (no AVX-512)")
TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K, Q.Q5_1, Q.Q5_K)


def _k(qtype: Q, k: int) -> int:
    """k rounded up to whole blocks of qtype (Q4_K's are 256 wide)."""
    block = gguf.constants.GGML_QUANT_SIZES[qtype][0]
    return -(-k // block) * block


def _extreme_scales(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """Row 0's blocks with the float16 scales' edge values: subnormal, large, -0, negative."""
    raw = raw.copy()
    block, nbytes = gguf.constants.GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(raw.shape[0], -1, nbytes)
    edges = np.array([2**-24, -(2**-24), 6.0e-5, 4096.0, -0.0, -1.5, 0.0], dtype=np.float16).view(np.uint8)
    at = 208 if qtype == Q.Q6_K else 0  # where a block's d is
    for b in range(blocks.shape[1]):
        blocks[0, b, at:at + 2] = edges.reshape(-1, 2)[b % 7]
        if qtype in (Q.Q4_1, Q.Q4_K, Q.Q5_1, Q.Q5_K):  # m, or the K-quants' dmin
            blocks[0, b, 2:4] = edges.reshape(-1, 2)[(b + 3) % 7]
    return raw


def _layers(qtype: Q, n: int, k: int, pairs: bool, seed: int) -> tuple[InvariantLinear, InvariantLinear, torch.Tensor]:
    """(float32 weight only, the same with its blocks, the loader's weight)."""
    raw = _extreme_scales(random_blocks(qtype, n, k, seed=seed), qtype)
    w = torch.from_numpy(gguf.quants.dequantize(raw, qtype))  # what the loader makes of the file
    plain, blocked = InvariantLinear(w, pairs=pairs), InvariantLinear(w, pairs=pairs)
    blocked.attach_f32_blocks(gguf_f32_blocks.blocks_of(torch.from_numpy(raw), qtype, n, pairs), FORMAT[qtype])
    return plain, blocked, w


@needs_avx2_tiles
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n,k", [(100, 96), (192, 320)])
def test_blocks_give_the_float32_kernels_bits_at_every_row_count(qtype, n, k):
    """1 to 9 rows cover the one-row tile, the 4-row tiles and every remainder; n = 100 a panel's
    partial store. The float32 kernel is itself the float64 product to float32 precision."""
    k = _k(qtype, k)
    plain, blocked, w = _layers(qtype, n, k, False, seed=21)
    gen = torch.Generator().manual_seed(22)
    bias = torch.randn(n, generator=gen)
    for m in range(1, BLOCKS_MAX_ROWS + 2):
        x = torch.randn(m, k, generator=gen)
        want = plain(x)
        assert torch.equal(blocked(x), want), f"{m} rows"
        assert torch.equal(blocked(x, bias), plain(x, bias)), f"{m} rows with a bias"
        ref = x.double() @ w.double().t()
        assert ((want.double() - ref).abs() <= k * 2**-24 * (x.double().abs() @ w.double().abs().t())).all()


@needs_avx2_tiles
@pytest.mark.parametrize("qtype", TYPES)
def test_blocks_of_a_paired_gate_up_give_its_bits(qtype):
    """A gate_up in the paired float32 layout: the plain output and the SiLU store."""
    k = _k(qtype, 64)
    plain, blocked, _ = _layers(qtype, 256, k, True, seed=23)
    gen = torch.Generator().manual_seed(24)
    for m in (1, 2, 4, 5, 8):
        x = torch.randn(m, k, generator=gen)
        assert torch.equal(blocked(x), plain(x)), f"{m} rows"
        assert torch.equal(blocked.forward_silu(x), plain.forward_silu(x)), f"{m} rows, silu"


@needs_avx2_tiles
def test_the_blocks_are_what_small_calls_read():
    """Blocks of another weight change calls of up to BLOCKS_MAX_ROWS rows and no larger one: the
    bit-for-bit tests above do not pass because the blocks go unused."""
    raw, other = random_blocks(Q.Q4_1, 64, 256, seed=25), random_blocks(Q.Q4_1, 64, 256, seed=26)
    layer = InvariantLinear(torch.from_numpy(gguf.quants.dequantize(raw, Q.Q4_1)))
    small, large = torch.randn(BLOCKS_MAX_ROWS, 256), torch.randn(BLOCKS_MAX_ROWS + 1, 256)
    before = layer(small), layer(large)
    layer.attach_f32_blocks(gguf_f32_blocks.blocks_of(torch.from_numpy(other), Q.Q4_1, 64, False), 0)
    assert not torch.equal(layer(small), before[0])
    assert torch.equal(layer(large), before[1])


def test_packing_places_each_weight_where_the_kernel_reads_it():
    """A naive unpacking of pack_q4 / pack_q8 (the layout the module docstring states) gives back
    every code and scale at its panel column; no kernel needed."""
    gen = torch.Generator().manual_seed(27)
    n, k = 100, 64
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    d, m = torch.randn(n, k // 32, generator=gen).half(), torch.randn(n, k // 32, generator=gen).half()
    packed = gguf_f32_blocks.pack_q4(codes, d, m)
    assert packed.shape == (2, 2, 1280)
    for col in (0, 7, 8, 63, 64, 99):
        p, c = divmod(col, 64)
        v, lane = divmod(c, 8)
        for kk in (0, 31, 32, 63):
            blk = packed[p, kk // 32]
            word = int.from_bytes(bytes(blk[256 + 32 * (kk % 32) + 4 * lane:][:4].tolist()), "little")
            assert (word >> (4 * v)) & 15 == codes[col, kk]
            assert blk[:128].view(torch.float16)[c] == d[col, kk // 32]
            assert blk[128:256].view(torch.float16)[c] == m[col, kk // 32]
    q8 = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    packed = gguf_f32_blocks.pack_q8(q8, d)
    assert packed.shape == (2, 2, 2176)
    for col in (0, 63, 64, 99):
        p, c = divmod(col, 64)
        for kk in (0, 33, 63):
            blk = packed[p, kk // 32]
            assert blk[128 + 64 * (kk % 32) + c].view(torch.int8) == q8[col, kk]
            assert blk[:128].view(torch.float16)[c] == d[col, kk // 32]


@needs_avx2_tiles
@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q4_K, Q.Q6_K, Q.Q5_1, Q.Q5_K])
def test_gguf_mode_block_layers_compute_from_the_blocks_at_every_size(qtype):
    """--quantization gguf keeps these types as GGUFBlockLinear; on the AVX2 tiles it keeps them as
    blocks in panel order, and its float32 calls of every size (a prefill chunk's too) take the
    blocks kernel: linear_f32's bits on the loader's weight, where the per-tile decode it replaces
    is only close to them."""
    from tessera.quant.gguf_kquant import GGUFBlockLinear

    raw = _extreme_scales(random_blocks(qtype, 100, 512, seed=29), qtype)
    layer = GGUFBlockLinear(torch.from_numpy(raw.copy()), qtype)
    assert layer.kernels == ("blocks", "dequant") and layer.select_kernel(300) == "blocks"
    w = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    # the blocks are the layer's only copy: its dequantization (and embedding rows) come from them
    assert not hasattr(layer, "raw")
    assert torch.equal(layer.dequantize().view(torch.int32), w.view(torch.int32))
    ids = torch.tensor([[99, 0], [64, 63]])
    assert torch.equal(layer.dequantize_rows(ids).view(torch.int32), w[ids].view(torch.int32))
    plain = InvariantLinear(w)
    gen = torch.Generator().manual_seed(30)
    for m in (1, 5, 8, 9, 130):
        x = torch.randn(m, 512, generator=gen)
        assert torch.equal(layer(x), plain(x)), f"{m} rows"
        bound = 512 * 2**-23 * (x.double().abs() @ w.double().abs().t())  # two float32 sums' rounding
        assert ((layer(x, kernel="dequant").double() - plain(x).double()).abs() <= bound).all()


def _blocked(model) -> list[InvariantLinear]:
    return [m for m in model.modules() if isinstance(m, InvariantLinear) and m.f32_blocks is not None]


@needs_avx2_tiles
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_0, Q.Q5_0, Q.Q5_1])
@pytest.mark.parametrize("eager", [False, True])
def test_engine_with_blocks_equals_engine_without(tiny_model_factory, tmp_path, caplog, qtype, eager):
    """One engine, the same requests with the blocks and then without them (prefix caching off, so
    both compute every token). A 32-token budget puts prefill chunks (float32 panels above
    BLOCKS_MAX_ROWS rows) beside decodes; the tied lm_head reads its Q8_0 blocks."""
    from tessera.model.native_stack import NativeStack

    model_dir = tiny_model_factory(tie_word_embeddings=True)
    path = write_gguf_from_hf_dir(model_dir, tmp_path / "t.gguf", qtype=qtype,
                                  qtypes={"model.embed_tokens.weight": Q.Q8_0})
    with caplog.at_level(logging.INFO, logger="tessera"):
        engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", enforce_eager=eager, max_model_len=256,
                                        max_num_batched_tokens=32, enable_prefix_caching=False))
    assert "float32 linear weights from the GGUF blocks" in caplog.text
    model = engine.runner.model
    blocked = _blocked(model)
    assert len(blocked) == 4 * model.config.num_layers + 1  # qkv, o, gate_up, down; the lm_head
    assert model.lm_head.f32_blocks_format == FORMAT[Q.Q8_0]
    assert model.layers[0].mlp.gate_up_proj.pairs  # the paired layout's blocks too
    assert (model.native_stack is None) == eager
    if not eager:
        assert model.native_stack.lin_meta[::2] == [7] * (4 * model.config.num_layers)
    got = _generate(engine, "a")
    for m in blocked:
        m.f32_blocks = None
    if not eager:
        model.native_stack = NativeStack.build(model)  # its linears now kind 1 (float32 panels) again
    assert not _blocked(model)
    assert _generate(engine, "b") == got


def test_blocks_serve_float32_weights_on_the_avx2_tiles_only():
    if not kernels.available() or not kernels.cpu_has_avx512_bf16():
        pytest.skip("needs a bf16 InvariantLinear")
    layer = InvariantLinear(torch.randn(64, 64).bfloat16())
    with pytest.raises(ValueError, match="AVX2 tiles"):
        layer.attach_f32_blocks(torch.zeros(1, 2, 1280, dtype=torch.uint8), 0)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("pairs", [False, True])
def test_panel_weight_is_the_loaders_weight(qtype, pairs):
    """panel_weight (what the engine checks each weight's first panel with) unpacks a panel into
    gguf.quants' dequantization of the same columns: bit for bit, but for Q4_0's zero weights
    under a negative d (+0 against numpy's -0, which no FMA chain's output shows)."""
    raw = _extreme_scales(random_blocks(qtype, 128, _k(qtype, 96), seed=28), qtype)
    w = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    if pairs:  # the float32 panels' paired order (kernels/linear.py): 8 gate rows, then 8 up rows
        w = w.reshape(2, 8, 8, -1).transpose(0, 1).reshape(w.shape)
    blocks = gguf_f32_blocks.blocks_of(torch.from_numpy(raw), qtype, 128, pairs)
    for p in (0, 1):
        got = gguf_f32_blocks.panel_weight(blocks, FORMAT[qtype], p)
        want = w[64 * p: 64 * p + 64].t().contiguous()
        assert torch.equal(got, want)
        signs_differ = got.view(torch.int32) != want.view(torch.int32)
        assert (qtype == Q.Q4_0 or not signs_differ.any()) and (got[signs_differ] == 0).all()


@pytest.mark.parametrize("qtype", TYPES)
def test_block_bytes_are_what_the_layout_takes(qtype):
    """BLOCK_BYTES (what compare_floors counts a batch-1 step reading) against the packed size."""
    blocks = gguf_f32_blocks.blocks_of(torch.from_numpy(random_blocks(qtype, 128, 256, seed=31)), qtype, 128, False)
    assert blocks.numel() == 128 * 256 // 32 * gguf_f32_blocks.BLOCK_BYTES[qtype]


@needs_avx2_tiles
def test_gguf_mode_on_q5_1_blocks_equals_the_float32_engine(tiny_model_factory, tmp_path):
    """A Q5_1 file, every weight the lm_head included: --quantization gguf keeps only the blocks
    (GGUFBlockLinear, the embedding rows from them too) and the float32 engine dequantizes them at
    load; both compute from the same blocks with the float32 weights' bits, so their tokens and
    logprobs are equal, prefill chunks included."""
    from tessera.quant.gguf_kquant import GGUFBlockLinear

    path = write_gguf_from_hf_dir(tiny_model_factory(tie_word_embeddings=False), tmp_path / "t.gguf", qtype=Q.Q5_1)

    def check(model) -> None:
        layers = [m for m in model.modules() if isinstance(m, GGUFBlockLinear)]
        assert layers and all(m.f32_blocks is not None for m in layers)

    got = _generate_by_mode(path, "float32", check)
    assert got["gguf"] == got["none"]
