"""The fused elementwise C++ ops of a layer (tessera/kernels/csrc/fused_ops.cpp) against the
formulas transformers uses, computed here in float64 and rounded where HF rounds; a row's result
bit-identical whatever the row count; and the layers really taking the fused path."""

from __future__ import annotations

import pytest
import torch

from tessera import kernels
from tessera.model.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the fused ops need the C++ kernels")

# float32 runs on AVX-512 BF16 or on AVX2 + FMA (Zen 3: fused_avx2.cpp), bfloat16 on AVX-512 BF16 only.
NEEDS_FP32 = pytest.mark.skipif(not kernels.fused(torch.empty(0)), reason="needs AVX2 + FMA or AVX-512 BF16")
NEEDS_BF16 = pytest.mark.skipif(not kernels.cpu_has_avx512_bf16(), reason="needs AVX-512 BF16")
DTYPES = [pytest.param(torch.float32, id="float32", marks=NEEDS_FP32),
          pytest.param(torch.bfloat16, id="bfloat16", marks=NEEDS_BF16)]


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units of the last place between two same-dtype tensors."""
    bits = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    ia, ib = a.contiguous().view(bits).long(), b.contiguous().view(bits).long()
    return int((ia - ib).abs().max())


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: normalise in fp32 (here float64), round to the input dtype, scale by w."""
    x64 = x.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    if x.dtype != torch.float32:
        normed = normed.to(x.dtype).double()
    return (w.double() * normed).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 100])  # 100: a row's tail of 4 lanes (masked loads and stores)
def test_add_rms_norm_matches_hf_and_adds_in_the_model_dtype(dtype, width):
    torch.manual_seed(0)
    x, r = torch.randn(37, width).to(dtype), torch.randn(37, width).to(dtype)
    w = (1 + 0.1 * torch.randn(width)).to(dtype)
    normed, summed = kernels.ops().add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(summed, x + r)  # one rounding of the fp32 sum, as torch's bf16 add
    ulps = 1 if dtype == torch.bfloat16 else 4  # fp32: three roundings against float64
    assert ulps_apart(normed, hf_rms_norm(x + r, w, 1e-5)) <= ulps
    alone, same = kernels.ops().add_rms_norm(x, None, w, 1e-5)
    assert torch.equal(same, x)
    assert ulps_apart(alone, hf_rms_norm(x, w, 1e-5)) <= ulps


def hf_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb in float64: x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)."""
    half = x.shape[-1] // 2
    x64 = x.double()
    c, s = torch.cat([cos, cos], -1).double(), torch.cat([sin, sin], -1).double()
    rotated = torch.cat([-x64[..., half:], x64[..., :half]], -1)
    return x64 * c + rotated * s


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_hf_on_a_strided_view_of_qkv(dtype):
    torch.manual_seed(1)
    rope = RotaryEmbedding(64, 10000.0, None, 128)
    t, heads, kv = 11, 6, 2
    qkv = torch.randn(t, (heads + 2 * kv) * 64).to(dtype)
    positions = torch.tensor([0, 1, 2, 5, 9, 17, 33, 64, 100, 127, 200])  # 200: the table grows
    qk = qkv[:, : (heads + kv) * 64].view(t, heads + kv, 64)
    out = rope.at(positions, dtype).apply(qk)
    cos, sin = rope.cos_sin(positions, dtype)  # in the model dtype, as HF rounds them
    expected = hf_rotate(qk, cos, sin)
    assert out.shape == (t, heads + kv, 64) and out.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    if dtype == torch.bfloat16:
        assert ulps_apart(out, expected.to(dtype)) <= 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [5, 40])  # a decode's few rows; a prefill's rows split over the threads
@pytest.mark.parametrize("d", [64, 40])  # 40: half a head is 20, a tail of 4 lanes
def test_rotary_kv_rotates_q_and_k_and_writes_the_caches(dtype, t, d):
    """rotary_kv (the native stack's rotary + cache write in one pass) against HF's rotation in
    float64 and index_copy_ into the caches, and bit for bit against rotary then write_kv; a slot
    past the cache is refused before anything is written."""
    gen = torch.Generator().manual_seed(4)
    heads, kv = 6, 2
    rope = RotaryEmbedding(d, 10000.0, None, 256)
    qkv = torch.randn(t, (heads + 2 * kv) * d + 8, generator=gen).to(dtype)[:, 8:]  # a strided view
    positions = torch.randint(0, 256, (t,), generator=gen)
    n_slots = 3 * t
    slots = torch.randperm(n_slots, generator=gen)[:t]
    caches = [torch.randn(n_slots, kv, d, generator=gen).to(dtype) for _ in range(2)]
    before = [c.clone() for c in caches]
    rope.at(positions, dtype)
    q = kernels.ops().rotary_kv(qkv, rope._cos, rope._sin, positions, heads, kv, d, caches[0], caches[1], slots)

    qk = qkv[:, : (heads + kv) * d].view(t, heads + kv, d)
    cos, sin = rope.cos_sin(positions, dtype)
    expected = hf_rotate(qk, cos, sin)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert q.shape == (t, heads, d)
    torch.testing.assert_close(q.double(), expected[:, :heads], atol=tol, rtol=tol)
    torch.testing.assert_close(caches[0][slots].double(), expected[:, heads:], atol=tol, rtol=tol)
    if dtype == torch.bfloat16:
        assert ulps_apart(q, expected[:, :heads].to(dtype)) <= 1
        assert ulps_apart(caches[0][slots], expected[:, heads:].to(dtype)) <= 1
    written = slots.tolist()
    assert torch.equal(caches[1][slots], qkv[:, (heads + kv) * d:].view(t, kv, d))
    untouched = [i for i in range(n_slots) if i not in written]
    assert all(torch.equal(c[untouched], b[untouched]) for c, b in zip(caches, before, strict=True))

    # the unfused pair: the same bits
    rotated = kernels.ops().rotary(qkv, rope._cos, rope._sin, positions, heads + kv, d)
    ref = [b.clone() for b in before]
    kernels.ops().write_kv(rotated[:, heads:], qkv[:, (heads + kv) * d:].view(t, kv, d), ref[0], ref[1], slots)
    assert torch.equal(q, rotated[:, :heads]) and torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])

    bad = torch.cat([slots[:-1], torch.tensor([n_slots])])
    fresh = [b.clone() for b in before]
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.ops().rotary_kv(qkv, rope._cos, rope._sin, positions, heads, kv, d, fresh[0], fresh[1], bad)
    assert torch.equal(fresh[0], before[0]) and torch.equal(fresh[1], before[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 60])  # 60: a tail of 4 lanes
def test_silu_mul_matches_silu_then_product(dtype, inter):
    torch.manual_seed(2)
    gate_up = (3 * torch.randn(9, 2 * inter)).to(dtype)
    gate, up = gate_up.split(inter, -1)
    out = kernels.ops().silu_mul(gate_up)
    g = gate.double()
    act = (g / (1 + torch.exp(-g))).to(dtype)  # torch rounds silu's result, then the product
    expected = (act.double() * up.double()).to(dtype)
    assert ulps_apart(out, expected) <= (1 if dtype == torch.bfloat16 else 4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_result_does_not_depend_on_the_row_count(dtype):
    torch.manual_seed(3)
    x, r, w = torch.randn(70, 576).to(dtype), torch.randn(70, 576).to(dtype), torch.randn(576).to(dtype)
    gate_up = torch.randn(70, 2 * 1536).to(dtype)
    rope = RotaryEmbedding(64, 10000.0, None, 128)
    qk = torch.randn(70, 12, 64).to(dtype)
    positions = torch.arange(70)
    ops = kernels.ops()
    first_norm = ops.add_rms_norm(x[:1], r[:1], w, 1e-5)[0]
    first_act = ops.silu_mul(gate_up[:1])
    first_rot = rope.at(positions[:1], dtype).apply(qk[:1])
    for m in (2, 7, 16, 17, 33, 70):
        assert torch.equal(ops.add_rms_norm(x[:m], r[:m], w, 1e-5)[0][:1], first_norm)
        assert torch.equal(ops.silu_mul(gate_up[:m])[:1], first_act)
        assert torch.equal(rope.at(positions[:m], dtype).apply(qk[:m])[:1], first_rot)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_layers_take_the_fused_path_and_agree_with_their_torch_path(monkeypatch, dtype):
    torch.manual_seed(4)
    norm = RMSNorm(576, 1e-5, dtype)
    norm.weight.data = torch.randn(576).to(dtype)
    mlp = SwiGLUMLP(64, 96, dtype)
    mlp.gate_up_proj.data = torch.randn(192, 64).to(dtype)
    mlp.down_proj.data = torch.randn(64, 96).to(dtype)
    x, r, h = torch.randn(5, 576).to(dtype), torch.randn(5, 576).to(dtype), torch.randn(5, 64)
    h = h.to(dtype)
    calls = []
    ops = kernels.ops()

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(ops, name)

    monkeypatch.setattr(kernels, "ops", lambda: Spy())
    fused_norm, fused_sum = norm(x, r)
    fused_mlp = mlp(h)
    assert {"add_rms_norm", "silu_mul"} <= set(calls)
    monkeypatch.setattr(kernels, "fused", lambda x: False)
    plain_norm, plain_sum = norm(x, r)
    assert torch.equal(fused_sum, plain_sum) and ulps_apart(fused_norm, plain_norm) <= (1 if dtype == torch.bfloat16 else 4)
    torch.testing.assert_close(fused_mlp.float(), mlp(h).float(), atol=0.1, rtol=0.02)


@NEEDS_FP32
def test_bad_inputs_are_refused_with_the_reason():
    ops = kernels.ops()
    with pytest.raises(RuntimeError, match="position 9 is past the table"):
        ops.rotary(torch.randn(1, 64), torch.randn(4, 32), torch.randn(4, 32), torch.tensor([9]), 1, 64)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.add_rms_norm(torch.randn(8, 4).t(), None, torch.randn(8), 1e-5)


GATED_ARITHMETICS = [pytest.param(0, id="avx512", marks=NEEDS_BF16), pytest.param(1, id="amx", marks=pytest.mark.skipif(
    not kernels.cpu_has_amx_bf16(), reason="needs AMX bf16"))]


@pytest.mark.parametrize("arithmetic", GATED_ARITHMETICS)
@pytest.mark.parametrize(("inter", "k"), [(1536, 576), (64, 96), (48, 64), (40, 64)])
def test_gate_up_with_silu_in_its_epilogue_is_the_two_ops_bit_for_bit(arithmetic, inter, k):
    """linear_bf16_silu (the decoder stack's gate_up + silu_mul for a bf16 weight): on AMX the silu
    runs in the GEMM's store epilogue (gate block j beside up block j); it must equal silu_mul of
    linear_bf16's output at every row count (one and two row tiles, whole row blocks, a ragged
    last one). 40 columns of each: not a multiple of 16, the two ops in turn."""
    from tessera.kernels.linear import InvariantLinear

    g = torch.Generator().manual_seed(inter + k)
    lin = InvariantLinear((torch.randn(2 * inter, k, generator=g) * 0.1).bfloat16())
    ops = kernels.ops()
    for m in (1, 3, 16, 17, 31, 32, 33, 100, 257, 700):
        x = torch.randn(m, k, generator=g).bfloat16()
        fused = ops.linear_bf16_silu(x, lin.packed, 2 * inter, arithmetic)
        want = ops.silu_mul(ops.linear_bf16(x, lin.packed, None, 2 * inter, False, arithmetic))
        assert fused.shape == (m, inter) and torch.equal(fused.view(torch.int16), want.view(torch.int16)), m
