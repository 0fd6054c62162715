"""GGUF Q4_0 / Q4_1 / Q8_0 on int8 activations (tessera/quant/gguf_int8_activations.py,
tessera_gemv.q4x8 and q8x8): the layouts hold the file's weight, and the kernels equal the integer
formula they implement (activations quantized per 32 to int8, llama.cpp's Q8_1), computed here from
the file's bytes in float64."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from tessera.quant import native_gemv
from tessera.quant.gguf_int8_activations import (
    Q4BlocksLinear,
    Q8BlocksLinear,
    decode_q4_blocks,
    kquant_parts,
    pack_q4x8,
    pack_q8x8,
    unpack_q4x8,
    unpack_q8x8,
)
from tessera.quant.gguf_native import _blocks, decode_q8_0

needs_kernel = pytest.mark.skipif(not native_gemv.available(), reason="tessera_gemv (q4x8, q8x8) is not built here")


TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]


def quantized(qtype: Q, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, Q4BlocksLinear | Q8BlocksLinear]:
    """A random weight quantized by gguf-py (llama.cpp's rounding) and the layer built from its bytes."""
    w = (np.random.default_rng(seed).standard_normal((n, k)) * 0.05).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    if qtype == Q.Q8_0:
        return raw, Q8BlocksLinear(*decode_q8_0(raw, n))
    return raw, Q4BlocksLinear(*decode_q4_blocks(_blocks(raw, qtype, n), qtype))


def q8_1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes [M, K / 32, 32], d_x [M, K / 32]): d_x = amax / 127, codes round(x * 127 / amax)."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax != 0, torch.full_like(amax, 127).div(amax), torch.zeros_like(amax))  # a true division
    return (blocks * inv[..., None]).round(), amax / 127


def reference(x: torch.Tensor, raw: np.ndarray, qtype: Q) -> torch.Tensor:
    """sum over blocks of d d_x sum(q q_x) + m d_x sum(q_x), in float64, from the file's bytes."""
    n = raw.shape[0]
    blocks = _blocks(raw, qtype, n)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64))
    if qtype == Q.Q8_0:
        q, m = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).double(), torch.zeros_like(d)
    else:
        start = 4 if qtype == Q.Q4_1 else 2
        m = (torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64))
             if qtype == Q.Q4_1 else -8 * d)
        packed = torch.from_numpy(blocks[..., start:].copy())
        q = torch.cat([packed & 15, packed >> 4], dim=-1).double()  # [N, blocks, 32]: weight j low, j + 16 high
    qx, dx = q8_1(x)
    dot = torch.einsum("nbk,mbk->mnb", q, qx.double())
    return (dot * d[None] * dx.double()[:, None]).sum(-1) + (m[None] * (dx.double() * qx.double().sum(-1))[:, None]).sum(-1)


@pytest.mark.parametrize("n", [8, 37, 200])
def test_pack_and_unpack_are_inverse(n):
    codes = torch.randint(0, 16, (n, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    d, m = torch.rand(n, 3), torch.rand(n, 3)
    qs, dp, mp = pack_q4x8(codes, d, m)
    assert qs.shape == (-(-n // 8), 3, 128) and dp.shape == mp.shape == (-(-n // 8), 3, 8)
    back = unpack_q4x8(qs)
    assert torch.equal(back[:n], codes) and not back[n:].any()
    signed = torch.randint(-128, 128, (n, 96), dtype=torch.int8, generator=torch.Generator().manual_seed(n))
    qs8, d8 = pack_q8x8(signed, d)
    assert qs8.shape == (-(-n // 8), 3, 256) and d8.shape == (-(-n // 8), 3, 8)
    back8 = unpack_q8x8(qs8)
    assert torch.equal(back8[:n], signed) and not back8[n:].any()


@pytest.mark.parametrize("qtype", TYPES)
def test_layer_holds_the_files_weight(qtype):
    raw, layer = quantized(qtype, 37, 96)
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    # Q4_1 and Q8_0 as the file's dequantization, bit for bit; Q4_0: d q - 8 d against d (q - 8)
    exact = qtype != Q.Q4_0
    torch.testing.assert_close(layer.dequantize(), want, rtol=0 if exact else 1e-6, atol=0 if exact else 1e-7)
    ids = torch.tensor([[36, 0], [9, 9]])
    assert torch.equal(layer.dequantize_rows(ids), layer.dequantize()[ids])
    assert_rows_both_ways(layer, want)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(layer(x, kernel="dequant"), F.linear(x, want), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n,k", [(960, 576), (37, 64), (16, 1536)])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 20, 130])  # 130 x 576: x quantized on every thread
def test_kernel_equals_the_int8_formula(qtype, n, k, m):
    raw, layer = quantized(qtype, n, k, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    got = layer(x, kernel="native")
    want = reference(x, raw, qtype)
    assert got.shape == (m, n) and got.dtype == torch.float32
    # only float32 rounding of the per-block products and sums separates the two
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * float(want.abs().max()))


@needs_kernel
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K])
@pytest.mark.parametrize("m", [1, 9, 33, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_group_gives_the_same_bits_alone_as_beside_others(qtype, m, dtype):
    """On AVX-512 CPUs a q4x8 call of more than 32 rows (a prefill chunk) takes two groups of 8
    weight rows at a time on 512-bit vectors where a thread's tile holds two (q4x8_pair), a lone
    group and smaller calls the 256-bit path: the same arithmetic per column, so each group's
    columns must be the bits it gives as a weight of its own (one group: the 256-bit path)."""
    n, k = 56, 512  # 7 groups: pairs and a lone one in each thread's run
    if qtype == Q.Q4_K:
        raw, layer = kquant_layer(qtype, n, k, seed=5)
        alone = [kquant_layer_of(raw[8 * j : 8 * j + 8], qtype) for j in range(n // 8)]
    else:
        raw, layer = quantized(qtype, n, k, seed=5)
        alone = [Q4BlocksLinear(*decode_q4_blocks(_blocks(raw[8 * j : 8 * j + 8], qtype, 8), qtype))
                 for j in range(n // 8)]
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3).to(dtype)
    together = layer(x, kernel="native")
    for j, part in enumerate(alone):
        assert torch.equal(part(x, kernel="native"), together[:, 8 * j : 8 * j + 8]), f"group {j}"


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES)
def test_kernel_error_against_float_activations_is_the_rounding_of_x(qtype):
    """|native - x W^T| <= sum_k |W| d_x / 2: the int8 activation's rounding, and nothing else."""
    raw, layer = quantized(qtype, 64, 576, seed=3)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(5))
    w = layer.dequantize().double()
    exact = F.linear(x.double(), w)
    _, dx = q8_1(x)
    bound = torch.einsum("nbk,mb->mn", w.abs().view(64, -1, 32), dx.double()) / 2
    err = (layer(x, kernel="native").double() - exact).abs()
    assert (err <= bound * 1.0001 + 1e-6).all()
    assert err.max() > 0  # the activations were rounded (a kernel on float x would be far closer)


@needs_kernel
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
def test_rows_do_not_depend_on_the_batch(qtype):
    _, layer = quantized(qtype, 200, 576, seed=7)
    x = torch.randn(20, 576, generator=torch.Generator().manual_seed(20))
    together = layer(x, kernel="native")
    for i in (0, 7, 8, 19):
        assert torch.equal(layer(x[i : i + 1], kernel="native"), together[i : i + 1])
    assert torch.equal(layer(torch.zeros(2, 576), kernel="native"), torch.zeros(2, 200))


@needs_kernel
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
def test_bf16_activations_give_the_float32_result_rounded(qtype):
    # A bf16 step's linear is one call: the kernel reads bf16 x (exact in float32) and rounds its
    # float32 result to bf16 itself, as .to(bfloat16) would (ties to even); 40 rows (five of the
    # kernel's 8-row chunks), several column tiles and both halves of the thread split included.
    _, layer = quantized(qtype, 200, 576, seed=11)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(21)).bfloat16()
    op = torch.ops.tessera_gemv.q4x8 if qtype == Q.Q4_1 else torch.ops.tessera_gemv.q8x8
    args = (layer.qs, layer.d, layer.m) if qtype == Q.Q4_1 else (layer.qs, layer.d)
    y = op(x, *args)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y.view(torch.int16), op(x.float(), *args).bfloat16().view(torch.int16))
    assert torch.equal(layer(x, kernel="native").view(torch.int16),
                       layer(x.float(), kernel="native").bfloat16().view(torch.int16))


def assert_rows_both_ways(layer: Q4BlocksLinear | Q8BlocksLinear, want: torch.Tensor) -> None:
    """An embedding lookup's rows (every row of the weight, in a shuffled order with repeats) are the
    file's weight, from the torch gather and, where it is built, from the native op."""
    ids = torch.cat([torch.randperm(layer.out_features, generator=torch.Generator().manual_seed(5)), torch.tensor([0, 0])])
    exact = layer.dequantize()  # Q4_0's d q - 8 d may differ from gguf's d (q - 8) in the last bit
    assert torch.equal(layer._rows(ids // 8, ids % 8), exact[ids])
    if native_gemv.available():
        assert torch.equal(layer._native_rows(ids), exact[ids])
    torch.testing.assert_close(exact, want, rtol=1e-6, atol=1e-7)


@needs_kernel
def test_row_lookup_rejects_rows_outside_the_weight():
    _, layer = quantized(Q.Q8_0, 37, 64)  # 40 rows in the layout, 37 of them the weight's ...
    with pytest.raises(RuntimeError, match="row 40 is outside the 40 rows of qs"):
        torch.ops.tessera_gemv.q8x8_rows(layer.qs, layer.d, torch.tensor([3, 40]))
    with pytest.raises(RuntimeError, match=r"ids must be contiguous int64 \[R\]"):
        torch.ops.tessera_gemv.q8x8_rows(layer.qs, layer.d, torch.tensor([3], dtype=torch.int32))
    _, q4 = quantized(Q.Q4_1, 16, 64)
    with pytest.raises(RuntimeError, match="row -1 is outside"):
        torch.ops.tessera_gemv.q4x8_rows(q4.qs, q4.d, q4.m, torch.tensor([-1]))


@needs_kernel
def test_kernel_rejects_bad_input():
    _, layer = quantized(Q.Q4_1, 16, 64)
    with pytest.raises(RuntimeError, match=r"x must be contiguous float32 or bfloat16 \[M, 64\]"):
        torch.ops.tessera_gemv.q4x8(torch.randn(1, 32), layer.qs, layer.d, layer.m)
    with pytest.raises(RuntimeError, match="d and m must be contiguous float16"):
        torch.ops.tessera_gemv.q4x8(torch.randn(1, 64), layer.qs, layer.d.float(), layer.m)
    with pytest.raises(RuntimeError, match=r"qs must be contiguous uint8 \[N / 8, K / 32, 256\]"):
        torch.ops.tessera_gemv.q8x8(torch.randn(1, 64), layer.qs, layer.d)


# ---- Q5_0, Q4_K and Q6_K on the same two kernels (kquant_parts) ---------------------------------

KQUANT_ON_X8 = [Q.Q5_0, Q.Q4_K, Q.Q6_K]


def kquant_layer(qtype: Q, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, Q4BlocksLinear | Q8BlocksLinear]:
    """Random block bytes (every code and scale pattern) and the layer kquant_parts builds from them."""
    from tests.unit.test_gguf_kquant import random_blocks

    raw = random_blocks(qtype, n, k, seed)
    return raw, kquant_layer_of(raw, qtype)


def kquant_layer_of(raw: np.ndarray, qtype: Q):
    """The layer kquant_parts builds from these block bytes (rows of the file's tensor)."""
    from tessera.quant.gguf_native import _layer

    kind, *parts = kquant_parts(torch.from_numpy(raw.copy()), qtype)
    return _layer(kind, parts)


@pytest.mark.parametrize("qtype", KQUANT_ON_X8)
def test_kquant_layer_holds_the_files_weight_bit_for_bit(qtype):
    raw, layer = kquant_layer(qtype, 37, 512)
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    assert torch.equal(layer.dequantize().view(torch.int32), want.view(torch.int32))
    ids = torch.tensor([[36, 0], [9, 9]])
    assert torch.equal(layer.dequantize_rows(ids), want[ids])
    assert_rows_both_ways(layer, want)
    # Q5_0 as int8 codes with its float16 d (8.5 bits a weight); Q6_K's d * scale per 16 and Q4_K's
    # d * sc and dmin * mn per 32 in float32, exact there.
    assert layer.d.dtype == (torch.float16 if qtype == Q.Q5_0 else torch.float32)
    assert layer.d.shape[1] == 512 // (16 if qtype == Q.Q6_K else 32)


@needs_kernel
@pytest.mark.parametrize("qtype", KQUANT_ON_X8)
@pytest.mark.parametrize("n,k", [(64, 512), (37, 256), (200, 1536)])
@pytest.mark.parametrize("m", [1, 5, 9])
def test_kquant_kernel_is_the_weight_times_the_int8_rounded_activations(qtype, n, k, m):
    """The kernel's integer sums are exact, so against the file's weight (gguf's dequantization) times x
    rounded per 32 to int8 (llama.cpp's Q8_1), computed in float64, only float32 rounding is left."""
    raw, layer = kquant_layer(qtype, n, k, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    qx, dx = q8_1(x)
    x_rounded = (qx.double() * dx.double()[..., None]).view(m, k)
    want = x_rounded @ torch.from_numpy(gguf.quants.dequantize(raw, qtype)).double().t()
    got = layer(x, kernel="native")
    assert got.shape == (m, n) and got.dtype == torch.float32
    scale = float((x_rounded.abs() @ torch.from_numpy(gguf.quants.dequantize(raw, qtype)).double().abs().t()).max())
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * scale)


@needs_kernel
@pytest.mark.parametrize("qtype", KQUANT_ON_X8)
def test_kquant_rows_do_not_depend_on_the_batch(qtype):
    _, layer = kquant_layer(qtype, 96, 512, seed=11)
    x = torch.randn(20, 512, generator=torch.Generator().manual_seed(20))
    together = layer(x, kernel="native")
    for i in (0, 8, 19):
        assert torch.equal(layer(x[i : i + 1], kernel="native"), together[i : i + 1])


def test_q8x8_layout_takes_a_scale_per_32_or_per_16_only():
    with pytest.raises(ValueError, match="one per 32 or per 16"):
        pack_q8x8(torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 8))


def test_other_block_types_have_no_kquant_parts():
    assert kquant_parts(torch.zeros(1, 24, dtype=torch.uint8), Q.Q5_1) is None


@needs_kernel
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
def test_lm_head_logits_and_first_maximum_in_one_call(qtype):
    # An lm_head on bf16 x: the logits are forward(x).float() and the ids torch.argmax's of them. Rows
    # 90, 91 and 150 of the weight are equal and point along x's first row, so they tie for its
    # maximum across lanes and across the two threads' halves of the columns (the first, 90, wins).
    w = (np.random.default_rng(5).standard_normal((200, 576)) * 0.05).astype(np.float32)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(22)).bfloat16()
    w[[90, 91, 150]] = x[0].float().numpy() * 0.2
    raw = gguf.quants.quantize(w, qtype)
    layer = (Q8BlocksLinear(*decode_q8_0(raw, 200)) if qtype == Q.Q8_0
             else Q4BlocksLinear(*decode_q4_blocks(_blocks(raw, qtype, 200), qtype)))
    want = layer(x, kernel="native").float()
    logits, ids = layer.logits_argmax(x)
    assert logits.dtype == torch.float32 and torch.equal(logits, want)
    assert torch.equal(ids, want.argmax(-1)) and ids[0] == 90
    empty, only_ids = layer.logits_argmax(x, logits=False)
    assert empty.shape == (40, 0) and torch.equal(only_ids, ids)
    odd = Q8BlocksLinear(*decode_q8_0(gguf.quants.quantize(w[:196], Q.Q8_0), 196))
    assert odd.logits_argmax(x) is None  # its padding rows would join the race
