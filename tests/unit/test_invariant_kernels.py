"""The batch-invariant C++ kernels (tessera/kernels): exact against float64 references, and a
row's result bit-identical whatever else runs with it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tessera import kernels
from tessera.attention import invariant_cpu
from tessera.attention.invariant_cpu import InvariantCPUAttention
from tessera.attention.metadata import AttentionMetadata, PrefillSpan, slots_for_positions
from tessera.kernels import linear
from tessera.kernels.linear import InvariantLinear, supported

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the C++ kernels did not build here")

DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not supported(torch.bfloat16), reason="bf16 invariant linear needs AVX-512 BF16 or AMX"))]

# The bf16 linear's two arithmetics (tessera.kernels.linear.BF16_ARITHMETIC): AVX-512 BF16 dot
# products, and AMX tiles where the CPU has them. Float32 has one.
LINEAR_CASES = [(torch.float32, -1),
                pytest.param(torch.bfloat16, 0, id="bf16-avx512", marks=pytest.mark.skipif(
                    not supported(torch.bfloat16), reason="bf16 invariant linear needs AVX-512 BF16")),
                pytest.param(torch.bfloat16, 1, id="bf16-amx", marks=pytest.mark.skipif(
                    not kernels.cpu_has_amx_bf16(), reason="the AMX linear needs a CPU with AMX"))]

# The attention kernel's arithmetics: fp32 AVX-512 everywhere; for bf16 AMX tiles, or the scores
# as AVX-512 BF16 pair dot products, where the CPU has them.
ARITHMETICS = ["avx512",
               pytest.param("amx", marks=pytest.mark.skipif(
                   not kernels.cpu_has_amx_bf16(), reason="the AMX attention needs a CPU with AMX")),
               pytest.param("bf16pairs", marks=pytest.mark.skipif(
                   not kernels.cpu_has_avx512_bf16(), reason="the pair arithmetic needs AVX-512 BF16"))]
_ARITHMETIC_CODE = {"avx512": 0, "amx": 1, "bf16pairs": 2}


def _use_arithmetic(monkeypatch, arithmetic, applies):
    """avx512: the kernel's fp32 AVX-512 path. amx, bf16pairs: required (the kernel raises if it
    cannot take it), so the case really runs on that arithmetic; cases it does not cover
    (`applies` false: not bf16 with head_dim a multiple of 32) are skipped."""
    if arithmetic != "avx512" and not applies:
        pytest.skip(f"the {arithmetic} arithmetic covers bf16 caches with head_dim a multiple of 32")
    monkeypatch.setattr(invariant_cpu, "AMX", _ARITHMETIC_CODE[arithmetic])


@pytest.mark.parametrize(("dtype", "arithmetic"), LINEAR_CASES)
@pytest.mark.parametrize("shape", [(96, 64), (100, 40), (1728, 576), (33, 70), (50, 33)])
def test_linear_matches_reference_and_is_row_invariant(dtype, arithmetic, shape, monkeypatch):
    monkeypatch.setattr(linear, "BF16_ARITHMETIC", arithmetic)
    gen = torch.Generator().manual_seed(0)
    n, k = shape
    weight = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    # 300 rows: AMX runs 32-row groups and a last 16-row group with one A tile, AVX-512 96-row
    # tasks of 6-row register tiles and a shorter last tile. A row's bits must not care.
    x = torch.randn(300, k, generator=gen).to(dtype)
    layer = InvariantLinear(weight)
    y = layer(x, bias)
    ref = F.linear(x.double(), weight.double(), bias.double())
    tol = 1e-4 if dtype == torch.float32 else 8e-3  # bf16: the output's own rounding
    assert y.dtype == dtype and y.shape == (300, n)
    assert ((y.double() - ref).abs() / ref.abs().max()).max() < tol
    # Row 5 (and row 0) alone, in a small batch, in an odd-sized one: the same bits.
    for m in (1, 2, 6, 17, 32, 33, 64, 129):
        part = layer(x[:m], bias)
        assert torch.equal(part[0], y[0])
        if m > 5:
            assert torch.equal(part[5], y[5])
        assert torch.equal(layer(x[-m:], bias)[-1], y[-1])  # the last row, from the tail's single A tile
    # The rows around it do not matter either.
    shuffled = torch.cat([torch.randn(3, k, generator=gen).to(dtype), x[5:6]])
    assert torch.equal(layer(shuffled, bias)[3], y[5])
    # The logits' one-pass float output: exactly the rounded output widened.
    wide = layer.forward_float(x)
    assert wide.dtype == torch.float32 and torch.equal(wide, layer(x).float())


@pytest.mark.parametrize(("dtype", "arithmetic"), LINEAR_CASES)
@pytest.mark.parametrize("threads", [2, 3, 8, 16])
def test_linear_bits_do_not_depend_on_the_thread_count(dtype, arithmetic, threads, monkeypatch):
    # The AVX-512 kernel splits C into rows x column blocks by the thread count (at 8 threads a
    # 64-column linear of 300 rows takes 2 row shares x 4 column shares, at 2 one column share
    # each): who computes a row must not change its bits. 1 thread is the reference.
    monkeypatch.setattr(linear, "BF16_ARITHMETIC", arithmetic)
    gen = torch.Generator().manual_seed(threads)
    before = torch.get_num_threads()
    for n, k, m in [(64, 96, 300), (1728, 576, 33), (40, 70, 7), (576, 576, 1)]:
        weight = torch.randn(n, k, generator=gen).to(dtype)
        layer = InvariantLinear(weight)
        x = torch.randn(m, k, generator=gen).to(dtype)
        try:
            torch.set_num_threads(1)
            alone = layer(x)
            torch.set_num_threads(threads)
            split = layer(x)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(split, alone), (n, k, m)
        ref = F.linear(x.double(), weight.double())
        assert ((split.double() - ref).abs() / ref.abs().max()).max() < (1e-4 if dtype == torch.float32 else 8e-3)


def test_float32_linear_is_one_fma_chain_over_k_in_order():
    """The float32 kernel's arithmetic, on every CPU (the AVX-512 loop and the AVX2 register tiles
    alike): out = fma(x[k-1], w[k-1], ... fma(x[0], w[0], 0)) + bias. Emulated here with each fma
    as an exact float64 product and sum rounded to float32 (a double rounding that can differ from
    the fused one only at near-ties, which these values do not hit)."""
    gen = torch.Generator().manual_seed(11)
    n, k = 136, 70  # a ragged last panel
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    # 13 rows: 6-row tiles and a 1-row rest; 1 and 4 rows: a thread's two halves of a panel as one
    # item (f32_gemm_avx2.cpp), beside halves left apart at the threads' boundary
    for m in (13, 1, 4):
        x = torch.randn(m, k, generator=gen)
        acc = torch.zeros(m, n)
        for j in range(k):
            acc = (x[:, j:j + 1].double() * weight[:, j].double() + acc.double()).float()
        assert torch.equal(InvariantLinear(weight)(x, bias), acc + bias), m
        assert torch.equal(InvariantLinear(weight)(x), acc + 0.0), m


@pytest.mark.skipif(not linear.pairs_layout_fits(torch.empty(64, 8)),
                    reason="the paired gate_up layout is the AVX2 tiles' (CPUs without AVX-512)")
def test_float32_gate_up_in_pairs_gives_the_plain_linear_and_its_silu_mul_bit_for_bit():
    """A gate_up weight packed in pairs (8 gate rows, then the same 8 up rows) stores the plain
    output's columns in the plain order, each the one FMA chain of the test above (emulated the
    same way), and forward_silu gives silu_mul of that output: every row count's tiles (6-row
    tiles, the 1-5 row rests, 48-row groups), with and without a bias."""
    gen = torch.Generator().manual_seed(12)
    inter, k = 96, 70  # three 64-column panels of pairs; k not a multiple of 8
    weight, bias = torch.randn(2 * inter, k, generator=gen), torch.randn(2 * inter, generator=gen)
    paired, plain = InvariantLinear(weight, pairs=True), InvariantLinear(weight)
    assert paired.pairs and not plain.pairs
    for m in (1, 2, 3, 5, 7, 13, 49):
        x = torch.randn(m, k, generator=gen)
        acc = torch.zeros(m, 2 * inter)
        for j in range(k):
            acc = (x[:, j:j + 1].double() * weight[:, j].double() + acc.double()).float()
        assert torch.equal(paired(x, bias), acc + bias)
        assert torch.equal(paired(x), acc + 0.0)
        expected = kernels.ops().silu_mul(plain(x))
        assert torch.equal(paired.forward_silu(x), expected)
        assert torch.equal(plain.forward_silu(x), expected)
        # silu_mul itself: silu(gate) * up within float32 rounding of the formula
        gate, up = (acc + 0.0).double().split(inter, dim=-1)
        torch.testing.assert_close(expected.double(), gate * torch.sigmoid(gate) * up, rtol=1e-5, atol=1e-5)


def test_only_a_float32_swiglu_gate_up_on_the_avx2_tiles_is_paired(tiny_model_factory):
    """make_linears_invariant pairs the gate_up of a SwiGLU MLP where the layout fits, and no other
    weight; where it does not fit (AVX-512 CPUs, bf16, other sizes), asking for it is an error."""
    from tessera.config import EngineConfig
    from tessera.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory()), dtype="float32", deterministic=True))
    model = engine.runner.model
    paired = {name for name, mod in model.named_modules() if getattr(mod, "pairs", False)}
    fits = linear.pairs_layout_fits(torch.empty(64, 8))
    assert paired == ({f"layers.{i}.mlp.gate_up_proj" for i in range(len(model.layers))} if fits else set())
    if not fits:
        with pytest.raises(ValueError, match="paired gate_up layout"):
            InvariantLinear(torch.randn(64, 8), pairs=True)
    with pytest.raises(ValueError, match="paired gate_up layout"):
        InvariantLinear(torch.randn(48, 8), pairs=True)  # 2 x 24 rows: not whole 64-column panels


def _naive_attention(q, k_cache, v_cache, slots, scale):
    """q [H, d] attending to the cache rows `slots` (float64, exact softmax)."""
    h, d = q.shape
    hkv = k_cache.shape[1]
    keys, values = k_cache[slots].double(), v_cache[slots].double()
    out = torch.empty(h, d, dtype=torch.float64)
    for head in range(h):
        kv = head // (h // hkv)
        probs = torch.softmax(keys[:, kv] @ q[head].double() * scale, dim=0)
        out[head] = probs @ values[:, kv]
    return out.reshape(-1)



def _f32(x):
    return np.asarray(x, dtype=np.float64).astype(np.float32)


def _fma(a, b, c):
    """fp32 fused multiply-add: the float64 product of two float32 is exact; the sum is rounded
    to float64, then to float32 (a double rounding, off only at near-ties these values avoid)."""
    return _f32(np.float64(a) * np.float64(b) + np.float64(c))


def _kernel_score(q, k):
    """The attention kernel's fp32 score q . k on every CPU: chain l sums q[d] k[d] over d = l,
    l + 8, ... in order (a product, then FMAs), then ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))."""
    a = [_f32(q[..., lane] * k[..., lane]) for lane in range(8)]
    for i in range(8, q.shape[-1], 8):
        a = [_fma(q[..., i + lane], k[..., i + lane], a[lane]) for lane in range(8)]
    b = [_f32(a[i] + a[i + 4]) for i in range(4)]
    return _f32(_f32(b[0] + b[2]) + _f32(b[1] + b[3]))


def _kernel_exp(x):
    """The kernel's softmax exp: clamp, n = round(x log2 e), a two-step reduction, a degree-6
    polynomial, times 2^n by the exponent bits; 0 where x is not above -87."""
    xc = np.minimum(np.maximum(x, _f32(-87.0)), _f32(88.0))
    n = np.rint(_f32(xc * _f32(1.44269504088896341)))
    r = _fma(-n, _f32(0.693145751953125), xc)
    r = _fma(-n, _f32(1.428606765330187e-06), r)
    p = _f32(1.3981999507e-3)
    for c in (8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = _fma(p, r, _f32(c))
    p = _fma(p, _f32(r * r), _f32(r + _f32(1.0)))
    e = (p.view(np.int32) + (n.astype(np.int32) << 23)).view(np.float32)
    return np.where(x > _f32(-87.0), e, _f32(0.0))


def test_float32_attention_scores_are_the_fixed_chains_and_tree():
    """The float32 arithmetic every CPU shares (AVX-512 scores 16 keys from a transposed tile, AVX2
    scores each key from its cache row in its own register: both must give these bits). Two keys
    a sequence, values 0 and 1, so each output element is e2 / (e1 + e2) as the kernel rounds it:
    fp32 scores by the fixed chains and tree, the kernel's exp of each score minus the max, and
    the sum, reciprocal and product in fp32."""
    gen = torch.Generator().manual_seed(7)
    h, hkv, d, block_size, batch = 9, 3, 64, 16, 32
    k_cache = torch.randn((batch + 1) * block_size, hkv, d, generator=gen)
    v_cache = torch.zeros_like(k_cache)
    v_cache.view(batch + 1, block_size, hkv, d)[:, 1] = 1.0  # each block's second key: ones
    tables = [[i + 1] for i in range(batch)]
    md = _metadata(tables, [2] * batch, [], block_size)
    q = torch.randn(batch, h, d, generator=gen) * 2.0
    backend = InvariantCPUAttention()
    backend.begin_step(md)
    k_new, v_new = k_cache[md.slot_mapping].clone(), v_cache[md.slot_mapping].clone()
    out = backend.forward(0, q, k_new, v_new, (k_cache, v_cache), md, 1.0).view(batch, h, d)

    keys = k_cache.view(batch + 1, block_size, hkv, d)[1:, :2].numpy()  # [batch, 2 keys, hkv, d]
    kv = np.arange(h) // (h // hkv)
    qn = q.numpy()

    def expected(score):
        s1, s2 = score(qn, keys[:, 0, kv]), score(qn, keys[:, 1, kv])  # [batch, h]
        mx = np.maximum(s1, s2)
        e1, e2 = _kernel_exp(_f32(s1 - mx)), _kernel_exp(_f32(s2 - mx))
        return _f32(e2 * _f32(_f32(1.0) / _f32(e1 + e2)))

    want = expected(_kernel_score)
    got = out[:, :, 0].numpy()
    assert (out == out[:, :, :1]).all()  # every element of a row is the same e2 / (e1 + e2)
    assert np.array_equal(got, want)
    # The test tells summation orders apart: summing d in plain order gives other bits somewhere.
    def in_order(a, b):
        acc = _f32(a[..., 0] * b[..., 0])
        for i in range(1, a.shape[-1]):
            acc = _fma(a[..., i], b[..., i], acc)
        return acc
    assert not np.array_equal(expected(in_order), want)

def _metadata(decode_tables, decode_ctx, spans, block_size):
    """Decodes (table, ctx) then prefill spans (table, context_len, query_len)."""
    slot_mapping, prefills = [], []
    decode_slots = None
    mask = None
    if decode_tables:
        width = max(decode_ctx)
        rows = [slots_for_positions(t, 0, c, block_size) + [0] * (width - c) for t, c in zip(decode_tables, decode_ctx, strict=True)]
        decode_slots = torch.tensor(rows)
        mask = (torch.arange(width) < torch.tensor(decode_ctx).unsqueeze(1)).view(len(rows), 1, 1, width)
        slot_mapping += [r[c - 1] for r, c in zip(rows, decode_ctx, strict=True)]
    start = len(slot_mapping)
    for table, ctx, qlen in spans:
        slots = torch.tensor(slots_for_positions(table, 0, ctx, block_size))
        prefills.append(PrefillSpan(start, qlen, ctx, slots))
        slot_mapping += slots[ctx - qlen:].tolist()
        start += qlen
    return AttentionMetadata(torch.tensor(slot_mapping), len(decode_ctx), decode_slots, mask, prefills,
                             block_size=block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (6, 2, 80): a head_dim that is not a multiple of 64 (P.V once ran past the row there).
@pytest.mark.parametrize("heads", [(4, 2, 16), (9, 3, 64), (4, 1, 32), (6, 2, 80)])
@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("arithmetic", ARITHMETICS)
# q as the model passes it: the query heads of the fused qkv output, rows (H + 2 Hkv) * d apart,
# which the kernel reads in place.
@pytest.mark.parametrize("q_view", [False, True])
def test_paged_attention_matches_softmax_formula(dtype, heads, block_size, arithmetic, q_view, monkeypatch):
    h, hkv, d = heads
    _use_arithmetic(monkeypatch, arithmetic, dtype == torch.bfloat16 and d % 32 == 0)
    gen = torch.Generator().manual_seed(1)
    num_blocks = 64
    k_cache = torch.randn(num_blocks * block_size, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, hkv, d, generator=gen).to(dtype)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    need = lambda c: -(-c // block_size)  # noqa: E731
    decode_ctx = [1, 37, 5]
    spans = [(70, 70), (50, 9)]  # a fresh prompt, and a chunk after 41 cached positions
    tables, cursor = [], 0
    for c in decode_ctx + [ctx for ctx, _ in spans]:
        tables.append(perm[cursor: cursor + need(c)])
        cursor += need(c)
    md = _metadata(tables[:3], decode_ctx, [(t, c, n) for t, (c, n) in zip(tables[3:], spans, strict=True)], block_size)
    num_tokens = md.num_tokens
    q = torch.randn(num_tokens, h + 2 * hkv if q_view else h, d, generator=gen).to(dtype)[:, :h]
    assert q.is_contiguous() != q_view
    k_new = k_cache[md.slot_mapping].clone()  # write what is there: the cache stays as generated
    v_new = v_cache[md.slot_mapping].clone()
    backend = InvariantCPUAttention()
    backend.begin_step(md)
    out = backend.forward(0, q, k_new, v_new, (k_cache, v_cache), md, d**-0.5)
    # Every token against the formula over exactly its context.
    contexts = [slots_for_positions(t, 0, c, block_size) for t, c in zip(tables[:3], decode_ctx, strict=True)]
    for table, (ctx, qlen) in zip(tables[3:], spans, strict=True):
        contexts += [slots_for_positions(table, 0, ctx - qlen + j + 1, block_size) for j in range(qlen)]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for t in range(num_tokens):
        ref = _naive_attention(q[t], k_cache, v_cache, torch.tensor(contexts[t]), d**-0.5)
        assert (out[t].double() - ref).abs().max() < tol, t
    # The last token of the chunk, run alone as a one-row decode: the same bits.
    last = num_tokens - 1
    alone = _metadata([tables[4]], [spans[1][0]], [], block_size)
    backend.begin_step(alone)
    single = backend.forward(0, q[last:], k_new[last:], v_new[last:], (k_cache, v_cache), alone, d**-0.5)
    assert torch.equal(single[0], out[last])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize("heads", [(9, 3), (4, 1), (5, 1)], ids=["gqa", "mqa", "mqa-odd"])
def test_a_lone_decode_split_over_kv_heads_equals_it_in_a_batch(dtype, arithmetic, heads, monkeypatch):
    """With fewer sequences than threads the kernel gives each KV head its own work item (one
    decode would otherwise run on one core), and with one KV head (MQA) each half of its query
    heads (not on AMX): the rows must be the bits they are in a batch, where one item covers all
    heads, and match the formula."""
    (h, hkv), d, block_size = heads, 64, 16
    _use_arithmetic(monkeypatch, arithmetic, dtype == torch.bfloat16)
    gen = torch.Generator().manual_seed(4)
    num_blocks = 80
    k_cache = torch.randn(num_blocks * block_size, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, hkv, d, generator=gen).to(dtype)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    ctxs = [300, 41, 77, 5, 260, 16, 99, 130]
    tables, cursor = [], 0
    for c in ctxs:
        tables.append(perm[cursor: cursor + -(-c // block_size)])
        cursor += -(-c // block_size)
    q = torch.randn(len(ctxs), h, d, generator=gen).to(dtype)
    backend = InvariantCPUAttention()

    def decode(rows):
        md = _metadata([tables[i] for i in rows], [ctxs[i] for i in rows], [], block_size)
        backend.begin_step(md)
        k_new, v_new = k_cache[md.slot_mapping].clone(), v_cache[md.slot_mapping].clone()
        return backend.forward(0, q[rows], k_new, v_new, (k_cache, v_cache), md, d**-0.5)

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batch = decode(list(range(len(ctxs))))  # 8 items: one per sequence, all heads
        alone = decode([0])  # 1 item < 2 threads: split per KV head
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone[0], batch[0])
    ref = _naive_attention(q[0], k_cache, v_cache, torch.tensor(slots_for_positions(tables[0], 0, ctxs[0], block_size)),
                           d**-0.5)
    assert (alone[0].double() - ref).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)


def _greedy(engine, prompts, max_tokens=12, with_logprobs=False):
    """Greedy token ids per prompt; with_logprobs: (token, logprob) pairs, whose exact float
    values show any change in the hidden states even where the argmax does not move."""
    from tessera.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=5 if with_logprobs else None)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                o = out.outputs[0]
                done[out.request_id] = ([sorted((t, lp.logprob) for t, lp in step.items()) for step in o.logprobs]
                                        if with_logprobs else o.token_ids)
        engine.check_invariants()
    return [done[str(i)] for i in range(len(prompts))]


def test_deterministic_puts_invariant_linears_in_a_float32_engine(tiny_model_dir):
    from tessera.config import EngineConfig
    from tessera.engine.engine import LLMEngine

    plain = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=1 << 22))
    det = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=1 << 22,
                                 deterministic=True))
    # Without the flag float32 takes them only where they beat MKL (AVX2 without AVX-512: Zen 3).
    plain_invariant = isinstance(plain.runner.model.layers[0].self_attn.qkv_proj, InvariantLinear)
    assert plain_invariant == linear.invariant_by_default(torch.float32)
    assert isinstance(det.runner.model.layers[0].self_attn.qkv_proj, InvariantLinear)
    assert isinstance(det.runner.model.lm_head, InvariantLinear)
    prompts = [[1, 5, 9, 13, 17, 21, 3], [2, 4, 6, 8]]
    # MKL and the fixed-order kernel agree to ~1e-6: the tiny model's greedy tokens do not move.
    assert _greedy(det, prompts) == _greedy(plain, prompts)


@pytest.mark.skipif(not supported(torch.bfloat16), reason="bf16 invariance by default needs AMX")
def test_bf16_prefix_cache_hit_and_batch_equal_the_request_alone(tiny_model_dir):
    from tessera.config import EngineConfig
    from tessera.engine.engine import LLMEngine

    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 200, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 200, (n,), generator=gen).tolist() for n in (3, 9, 17, 1, 30)]
    cfg = dict(model=str(tiny_model_dir), dtype="bfloat16", kv_cache_memory=1 << 22, block_size=8)
    alone = [_greedy(LLMEngine(EngineConfig(enable_prefix_caching=False, **cfg)), [p], with_logprobs=True)[0]
             for p in prompts]
    cached = LLMEngine(EngineConfig(enable_prefix_caching=True, max_num_batched_tokens=16, **cfg))
    _greedy(cached, prompts[:1])  # warms the prefix cache with the shared blocks
    assert cached.stats().prefix_cache_hits == 0
    # Batched, in chunks of 16 tokens, suffixes after cached blocks: the same top-5 logprobs, bit
    # for bit (with oneDNN's linears and the torch attention they differ in the last digits).
    assert _greedy(cached, prompts, with_logprobs=True) == alone
    assert cached.stats().prefix_cache_hits > 0


def _quantized_cache(k_cache, v_cache, kv_dtype):
    """(codes, codes, scales, scales) of a cache, and the dequantized float64 K and V the
    reference attends to."""
    from tessera.quant.kv import _FORMATS, dequantize, quantize

    (kc, ks), (vc, vs) = (quantize(c, _FORMATS[kv_dtype][0]) for c in (k_cache, v_cache))
    return (kc, vc, ks, vs), dequantize(kc, ks).double(), dequantize(vc, vs).double()


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("window", [None, 1, 13, 40])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("arithmetic", ARITHMETICS)
def test_paged_attention_window_and_quantized_kv(kv_dtype, window, block_size, arithmetic, monkeypatch):
    """Sliding windows and int8/fp8 caches in the kernel: every row against float64 attention
    over the dequantized keys inside its window, with the blocks behind every window released
    to block 0 (filled with NaN: a read of them would show); and each token of a prefill chunk
    run alone as a decode gives the same bits."""
    h, hkv, d = 9, 3, 64
    dtype = torch.bfloat16
    _use_arithmetic(monkeypatch, arithmetic, kv_dtype == "auto")
    gen = torch.Generator().manual_seed(7)
    num_blocks = 48
    k_src = torch.randn(num_blocks * block_size, hkv, d, generator=gen).to(dtype)
    v_src = torch.randn(num_blocks * block_size, hkv, d, generator=gen).to(dtype)
    if kv_dtype == "auto":
        cache, k_ref, v_ref = (k_src, v_src), k_src.double(), v_src.double()
    else:
        cache, k_ref, v_ref = _quantized_cache(k_src, v_src, kv_dtype)
    for t in cache[:2]:  # block 0: only padding and released blocks point there
        t.view(torch.uint8)[:block_size] = 0xFF  # NaN in bf16 and fp8
    for t in cache[2:]:
        t[:block_size] = float("nan")  # int8's scales
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    need = lambda c: -(-c // block_size)  # noqa: E731
    decode_ctx = [3, 45]
    spans = [(37, 37), (70, 22)]  # a fresh prompt, and a chunk after 48 cached positions
    tables, cursor = [], 0
    for c in decode_ctx + [ctx for ctx, _ in spans]:
        tables.append(perm[cursor: cursor + need(c)])
        cursor += need(c)
    if window is not None:  # release what is behind every row's window, as the scheduler does
        firsts = decode_ctx + [ctx - n + 1 for ctx, n in spans]
        for table, first_ctx in zip(tables, firsts, strict=True):
            for b in range(max(0, first_ctx - window) // block_size):
                table[b] = 0
    md = _metadata(tables[:2], decode_ctx, [(t, c, n) for t, (c, n) in zip(tables[2:], spans, strict=True)],
                   block_size)
    q = torch.randn(md.num_tokens, h, d, generator=gen).to(dtype)
    # New K/V: what the cache holds at those slots, so writing them back changes nothing.
    k_new = k_src[md.slot_mapping].clone()
    v_new = v_src[md.slot_mapping].clone()
    backend = InvariantCPUAttention()
    backend.begin_step(md)
    out = backend.forward(0, q, k_new, v_new, cache, md, d**-0.5, window)
    positions = [(t, c) for t, c in zip(tables[:2], decode_ctx, strict=True)]
    for table, (ctx, qlen) in zip(tables[2:], spans, strict=True):
        positions += [(table, ctx - qlen + j + 1) for j in range(qlen)]
    for row, (table, ctx) in enumerate(positions):
        first = 0 if window is None else max(0, ctx - window)
        slots = torch.tensor(slots_for_positions(table, first, ctx, block_size))
        ref = _naive_attention(q[row], k_ref, v_ref, slots, d**-0.5)
        assert (out[row].double() - ref).abs().max() < 2e-2, row
    # Tokens of the chunk (first, middle, last) run alone as one-row decodes: the same bits.
    chunk_start = md.num_tokens - spans[1][1]
    for j in (0, 9, spans[1][1] - 1):
        ctx = spans[1][0] - spans[1][1] + j + 1
        alone = _metadata([tables[3]], [ctx], [], block_size)
        backend.begin_step(alone)
        row = chunk_start + j
        single = backend.forward(0, q[row:row + 1], k_new[row:row + 1], v_new[row:row + 1], cache, alone,
                                 d**-0.5, window)
        assert torch.equal(single[0], out[row]), j


@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("arithmetic", ARITHMETICS)
def test_paged_attention_long_contexts_across_chunks(block_size, arithmetic, monkeypatch):
    """Contexts past the AMX path's 256-key chunks (a decode of 600 keys, a prefill chunk whose
    rows straddle positions 256 and 512, a GQA group of 4: 64 query rows per KV head in an item) against
    float64 attention; each row of the chunk alone as a decode gives the same bits."""
    h, hkv, d = 8, 2, 128
    _use_arithmetic(monkeypatch, arithmetic, True)
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(11)
    num_blocks = 2048 // block_size
    k_cache = torch.randn(num_blocks * block_size, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, hkv, d, generator=gen).to(dtype)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    need = lambda c: -(-c // block_size)  # noqa: E731
    decode_ctx = [600, 257]
    spans = [(530, 290)]  # rows at positions 240..529
    tables, cursor = [], 0
    for c in decode_ctx + [ctx for ctx, _ in spans]:
        tables.append(perm[cursor: cursor + need(c)])
        cursor += need(c)
    md = _metadata(tables[:2], decode_ctx, [(tables[2], *spans[0])], block_size)
    q = (torch.randn(md.num_tokens, h, d, generator=gen) * 2).to(dtype)  # peaked softmax rows too
    k_new, v_new = k_cache[md.slot_mapping].clone(), v_cache[md.slot_mapping].clone()
    backend = InvariantCPUAttention()
    backend.begin_step(md)
    out = backend.forward(0, q, k_new, v_new, (k_cache, v_cache), md, d**-0.5)
    positions = [(t, c) for t, c in zip(tables[:2], decode_ctx, strict=True)]
    positions += [(tables[2], spans[0][0] - spans[0][1] + j + 1) for j in range(spans[0][1])]
    for row, (table, ctx) in enumerate(positions):
        slots = torch.tensor(slots_for_positions(table, 0, ctx, block_size))
        ref = _naive_attention(q[row], k_cache, v_cache, slots, d**-0.5)
        assert (out[row].double() - ref).abs().max() < 2e-2, row
    chunk_start = 2
    for j in (0, 15, 16, 17, 272, 289):  # around the 256 and 512 chunk edges and the 16-row items
        ctx = spans[0][0] - spans[0][1] + j + 1
        alone = _metadata([tables[2]], [ctx], [], block_size)
        backend.begin_step(alone)
        row = chunk_start + j
        single = backend.forward(0, q[row:row + 1], k_new[row:row + 1], v_new[row:row + 1], (k_cache, v_cache),
                                 alone, d**-0.5)
        assert torch.equal(single[0], out[row]), j


@pytest.mark.parametrize("t", [5, 200])  # a decode's few rows on one thread; a prefill's split over threads
def test_write_kv_equals_index_copy_on_strided_views(t):
    """The one-call cache write against index_copy_: k and v as the model passes them (views into
    a fused [T, (H + 2 Hkv) d] row), every slot written, nothing else touched; a slot past the
    cache is refused."""
    h, hkv, d = 4, 2, 16
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=gen).to(torch.bfloat16)
    k = qkv[:, h * d:(h + hkv) * d].view(t, hkv, d)
    v = qkv[:, (h + hkv) * d:].view(t, hkv, d)
    n_slots = 16 if t <= 16 else 2 * t
    slots = torch.tensor([7, 0, 12, 3, 9]) if t == 5 else torch.randperm(n_slots, generator=gen)[:t]
    caches = [torch.randn(n_slots, hkv, d, generator=gen).to(torch.bfloat16) for _ in range(2)]
    ref = [c.clone() for c in caches]
    ref[0].index_copy_(0, slots, k)
    ref[1].index_copy_(0, slots, v)
    kernels.ops().write_kv(k, v, caches[0], caches[1], slots)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.ops().write_kv(k, v, caches[0], caches[1], torch.cat([slots[:-1], torch.tensor([n_slots])]))
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])  # the refused call wrote nothing
