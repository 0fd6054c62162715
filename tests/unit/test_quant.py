"""Quantized linear layers against exact references: round trips, every kernel against the
dequantized weight, W8A8 against an int64 reference, GGUF blocks against the gguf package.

These are the torch kernels (the layouts and kernels of CPUs without AMX), so every test here
builds its layers with TESSERA_QUANT_INVARIANT=0; the AMX batch-invariant kernel and its tile
layout are tested in test_quant_invariant.py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tessera.quant import native_gemv
from tessera.quant.gguf_native import Q8_0Linear, decode_q4_0, decode_q4_1, decode_q8_0
from tessera.quant.int4 import Int4Linear, _pack_codes_for_kernel, packed_layout, unpack_codes
from tessera.quant.int8 import Int8Linear
from tessera.quant.w8a8 import W8A8Linear, _pad_rows, quantize_per_token


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    monkeypatch.setenv("TESSERA_QUANT_INVARIANT", "0")


# Row counts cover decode (1), the kernel switch points (8 / 9), and prefill-sized calls.
ROWS = (1, 3, 8, 9, 33)
# Output sizes: a multiple of the int4 kernel's 32/64-row blocks, one with a 16-row tail, and one
# that needs padding (the tiny model's vocabulary is 267).
SHAPES = ((96, 64), (80, 128), (267, 64))


def weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0] = 0.0  # an all-zero row / group must not divide by zero
    w[1, : k // 2] = 0.3  # a constant group
    return w


def activations(m: int, k: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0, 3] = 8.0  # an outlier channel, as real activations have
    return x


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().t()


def bound(x: torch.Tensor, w: torch.Tensor, rel: float) -> torch.Tensor:
    """rel * sum_k |x_k w_k|: the natural error scale of a dot product computed with relative
    precision `rel` in each product and sum."""
    return rel * (x.double().abs() @ w.double().abs().t()) + 1e-12


# ---- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [Int8Linear, W8A8Linear])
def test_int8_round_trip(cls):
    w = weight(96, 64)
    layer = cls.from_float(w)
    deq = layer.dequantize()
    scale = layer.scale[:, None]
    # Each weight is within half a step (a step is the per-channel scale).
    assert ((deq - w).abs() <= 0.5 * scale * (1 + 1e-3) + 1e-9).all()
    # Quantizing the dequantized weight again gives the same codes and scales.
    again = cls.from_float(deq)
    assert torch.equal(again.dequantize(), deq)
    assert torch.equal(again.scale, layer.scale)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_round_trip(group_size):
    w = weight(80, 256)
    layer = Int4Linear.from_float(w, group_size)
    deq = layer.dequantize()
    n, k = w.shape
    sz = layer.scales_zeros[:, :n].float()  # [groups, N, 2]
    scale = sz[..., 0].t().repeat_interleave(group_size, dim=1)
    zero = sz[..., 1].t().repeat_interleave(group_size, dim=1)
    codes = layer.codes()
    assert codes.max() <= 15
    # dequantize() is exactly (q - 8) * s + z.
    assert torch.equal(deq, (codes.float() - 8) * scale + zero)
    # Within half a step, plus what rounding s and z to bf16 (8 significant bits) moves the grid.
    tol = 0.5 * scale + 15 * scale * 2**-8 + zero.abs() * 2**-8
    assert ((deq - w).abs() <= tol).all()


def test_int4_kernel_layout_round_trip():
    layout = packed_layout()
    assert layout in (32, 64)  # a vectorized build; 0 would mean the scalar layout
    g = torch.Generator().manual_seed(2)
    for n in (16, 48, 80, 96, 144):
        codes = torch.randint(0, 16, (n, 64), dtype=torch.uint8, generator=g)
        assert torch.equal(unpack_codes(_pack_codes_for_kernel(codes), n, 64, layout), codes)


def test_int4_from_codes_keeps_codes():
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (40, 64), dtype=torch.uint8, generator=g)  # 40 rows: padded to 48
    scale = torch.rand(40, 2, generator=g) + 0.5
    zero = torch.randn(40, 2, generator=g)
    layer = Int4Linear.from_codes(codes, scale, zero, 32)
    assert torch.equal(layer.codes(), codes)
    s = scale.to(torch.bfloat16).float().repeat_interleave(32, dim=1)
    z = zero.to(torch.bfloat16).float().repeat_interleave(32, dim=1)
    assert torch.equal(layer.dequantize(), (codes.float() - 8) * s + z)


def test_int4_group_size_must_divide():
    with pytest.raises(ValueError, match="group size 128 does not divide in_features 64"):
        Int4Linear.from_float(weight(32, 64), 128)


# ---- each kernel against the dequantized weight -------------------------------------------


def _layers(n: int, k: int):
    w = weight(n, k)
    return [Int8Linear.from_float(w), Int4Linear.from_float(w, 32), Int4Linear.from_float(w, 64)]


@pytest.mark.parametrize("n,k", SHAPES)
def test_weight_only_kernels_match_dequantized_reference(n, k):
    """bf16 kernels (int8pack, int4pack): the activations are rounded to bf16 (2^-8) and the
    output too, so the error bound is 2^-7 * sum |x w|. Float32 kernels: 1e-5 * sum |x w|."""
    for layer in _layers(n, k):
        w = layer.dequantize()
        for m in ROWS:
            x = activations(m, k)
            ref = reference(x, w)
            for kernel in layer.kernels:
                y = layer(x, kernel=kernel)
                assert y.shape == (m, n) and y.dtype == torch.float32
                rel = 2**-7 if kernel.endswith("pack") else 1e-5
                err = (y.double() - ref).abs()
                assert (err <= bound(x, w, rel)).all(), (type(layer).__name__, kernel, m, float(err.max()))


def test_bias_and_leading_dims():
    layer = Int8Linear.from_float(weight(96, 64))
    x = activations(6, 64).view(2, 3, 64)
    bias = torch.randn(96)
    y = layer(x, bias, kernel="dequant")
    ref = reference(x.view(6, 64), layer.dequantize()) + bias.double()
    assert y.shape == (2, 3, 96)
    torch.testing.assert_close(y.view(6, 96).double(), ref, rtol=1e-5, atol=1e-5)


def test_kernel_selection_by_rows():
    w = weight(96, 64)
    assert Int8Linear.from_float(w).select_kernel(1) == ("native" if native_gemv.available() else "int8pack")
    assert Int8Linear.from_float(w).select_kernel(256) == "dequant"
    int4_native = native_gemv.avx2_only() and native_gemv.available()  # gemv_avx2.cpp beats int4pack there
    assert Int4Linear.from_float(w, 32).select_kernel(1) == ("native" if int4_native else "int4pack")
    assert Int4Linear.from_float(w, 32).select_kernel(256) == "dequant"


# ---- W8A8: exact integer arithmetic ----------------------------------------------------------


def w8a8_reference(layer: W8A8Linear, x: torch.Tensor) -> torch.Tensor:
    """sx * sw * sum qx qw with the sum in int64 and the scaling in float64."""
    qx, sx = quantize_per_token(x)
    acc = qx.long() @ layer.codes().long().t()
    return acc.double() * layer.scale.double() * sx.double()


def w8a8_kernels(layer: W8A8Linear) -> tuple[str, ...]:
    return ("fbgemm", "int_mm") if layer.select_kernel(1) == "fbgemm" else ("int_mm",)


def test_per_token_activation_codes():
    x = activations(5, 576)
    qx, sx = quantize_per_token(x)
    assert torch.equal(qx, qx.round()) and qx.abs().amax(dim=1).eq(127).all()
    assert ((qx * sx - x).abs() <= 0.5 * sx * (1 + 1e-6)).all()
    zero_row, _ = quantize_per_token(torch.zeros(1, 8))
    assert not zero_row.any()


@pytest.mark.parametrize("n,k", SHAPES + ((64, 1536),))
def test_w8a8_kernels_are_exact(n, k):
    """The integer sums exactly; then only the float32 rounding of two scalings (a few ulp)."""
    layer = W8A8Linear.from_float(weight(n, k))
    for kernel in w8a8_kernels(layer):
        for m in ROWS + (64, 512):
            x = activations(m, k, seed=m)
            ref = w8a8_reference(layer, x)
            err = (layer(x, kernel=kernel).double() - ref).abs()
            assert (err <= 2**-21 * ref.abs()).all(), (kernel, m, float(err.max()))


def test_w8a8_worst_case_sums_do_not_saturate():
    """Every code at its extreme, every pair of products the same sign: an AVX2 int8 GEMM's int16
    pair sums saturate here unless the activations go in as non-negative halves (see w8a8.py)."""
    k = 1024  # the largest sum, 127 * 127 * 1024, stays below 2^24: exact in float32 too
    w = torch.full((32, k), 0.5)
    w[16:] = -0.5
    layer = W8A8Linear.from_float(w)
    x = torch.ones(4, k)
    x[1] = -1.0
    for kernel in w8a8_kernels(layer):
        ref = w8a8_reference(layer, x)
        assert layer.codes().abs().eq(127).all() and quantize_per_token(x)[0].abs().eq(127).all()
        torch.testing.assert_close(layer(x, kernel=kernel).double(), ref, rtol=2**-22, atol=0)


def test_w8a8_close_to_float():
    """The per-token activation quantization costs at most half a step per activation."""
    w = weight(96, 576)
    layer = W8A8Linear.from_float(w)
    x = activations(5, 576)
    step = x.abs().amax(dim=1, keepdim=True).double() / 127
    err = (layer(x).double() - reference(x, layer.dequantize())).abs()
    assert (err <= 0.5 * step * layer.dequantize().double().abs().sum(dim=1) + 1e-6).all()


def test_pad_rows_for_cuda_int_mm():
    x = torch.ones(3, 8, dtype=torch.int8)
    padded = _pad_rows(x, minimum=17, multiple=8)
    assert padded.shape == (24, 8) and torch.equal(padded[:3], x) and not padded[3:].any()
    assert _pad_rows(torch.ones(32, 8), minimum=17, multiple=8).shape == (32, 8)


# ---- GGUF blocks against the gguf package ---------------------------------------------------


def gguf_blocks(qtype: Q, n: int = 48, k: int = 128, seed: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """(raw blocks as llama.cpp writes them, gguf's own dequantization of them)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[:, :32] += 0.2  # a block with an offset, which only Q4_1's min captures
    raw = gguf.quants.quantize(w, qtype)
    return raw, gguf.quants.dequantize(raw, qtype).reshape(n, k)


def test_decode_q4_0_matches_gguf():
    raw, expected = gguf_blocks(Q.Q4_0)
    codes, d = decode_q4_0(raw, 48)
    w = (codes.float() - 8) * d.repeat_interleave(32, dim=1)
    np.testing.assert_array_equal(w.numpy(), expected)


def test_decode_q4_1_matches_gguf():
    raw, expected = gguf_blocks(Q.Q4_1)
    codes, d, m = decode_q4_1(raw, 48)
    w = codes.float() * d.repeat_interleave(32, dim=1) + m.repeat_interleave(32, dim=1)
    np.testing.assert_allclose(w.numpy(), expected, rtol=0, atol=1e-7)


def test_decode_q8_0_matches_gguf():
    raw, expected = gguf_blocks(Q.Q8_0)
    codes, d = decode_q8_0(raw, 48)
    layer = Q8_0Linear(codes, d)
    np.testing.assert_array_equal(layer.dequantize().numpy(), expected)
    x = activations(9, 128)
    for m in (1, 9):
        torch.testing.assert_close(layer(x[:m]).double(), reference(x[:m], torch.from_numpy(expected)),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_gguf_q4_on_the_int4_kernel(qtype):
    """Q4 blocks on the int4 kernel: the codes are the file's, the scales rounded from fp16 to
    bf16, so each weight moves by at most 2^-8 (8 |d| + |z|)."""
    raw, expected = gguf_blocks(qtype)
    if qtype == Q.Q4_0:
        codes, d = decode_q4_0(raw, 48)
        zero = torch.zeros_like(d)
    else:
        codes, d, m = decode_q4_1(raw, 48)
        zero = m + 8 * d
    layer = Int4Linear.from_codes(codes, d, zero, 32)
    want = torch.from_numpy(expected)
    tol = 2**-8 * (8 * d.abs() + zero.abs()).repeat_interleave(32, dim=1) * 1.01 + 1e-9
    assert ((layer.dequantize() - want).abs() <= tol).all()
    x = activations(4, 128)
    for kernel in layer.kernels:
        err = (layer(x, kernel=kernel).double() - reference(x, want)).abs()
        assert (err <= bound(x, want, 2**-7)).all()


# ---- tiled dequantization ----------------------------------------------------------------------


@pytest.mark.parametrize("n,k", SHAPES)
def test_tiled_dequant_kernels_across_tile_boundaries(monkeypatch, n, k):
    """With tiles of a few rows, every dequantizing kernel runs many tiles (uneven ones, and the
    int4 tail block of 16..48 rows) and still equals x @ dequantize().T; int4 at M = 130 takes
    the row-major tile path, below it the k-major block path."""
    import tessera.quant.int4 as int4
    import tessera.quant.linear as linear

    monkeypatch.setattr(linear, "TILE_BYTES", 4 * k * 24)  # 24 float32 rows a tile
    monkeypatch.setattr(int4, "TILE_BYTES", 4 * k * 24)
    w = weight(n, k)
    d = (w.view(n, -1, 32).abs().amax(-1) / 127).half().clamp_min(1e-4)
    q8 = torch.round(w.view(n, -1, 32) / d.float()[..., None]).clamp(-127, 127).to(torch.int8).view(n, k)
    layers = [Int8Linear.from_float(w), Int4Linear.from_float(w, 32), Q8_0Linear(q8, d)]
    for layer in layers:
        ref_w = layer.dequantize()
        for m in (9, 33, 130):
            x = activations(m, k)
            y = layer(x, kernel="dequant")
            assert y.shape == (m, n)
            err = (y.double() - reference(x, ref_w)).abs()
            assert (err <= bound(x, ref_w, 1e-5)).all(), (type(layer).__name__, m, float(err.max()))


def test_int4_dequantize_equals_codes_times_scales():
    """The tiled unpacking in the packed layout gives exactly (q - 8) * s + z."""
    layer = Int4Linear.from_float(weight(267, 64), 32)
    q = layer.codes().float().view(267, 2, 32)
    sz = layer.scales_zeros[:, :267].float()  # [groups, N, 2]
    expected = (q - 8) * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]
    assert torch.equal(layer.dequantize(), expected.view(267, 64))
