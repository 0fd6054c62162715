"""The batch-invariant quantized kernel (tessera/quant/invariant.py): a row's result is the same
bit for bit whatever the number of rows in the call, and it equals float64 math on the layer's
dequantized weight within the kernel's precision; then the same at engine level (a request alone,
in a batch, and on a prefix-cache hit give identical tokens and logprobs) per quantization mode."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tessera import SamplingParams
from tessera.config import EngineConfig
from tessera.engine.engine import LLMEngine
from tessera.quant import invariant
from tessera.quant.gguf_kquant import GGUFBlockLinear
from tessera.quant.gguf_native import Q8_0Linear, decode_q4_1, decode_q8_0
from tessera.quant.int4 import Int4Linear
from tessera.quant.int8 import Int8Linear
from tessera.quant.w8a8 import W8A8Linear, quantize_per_token
from tests.tiny_model import write_gguf_from_hf_dir
from tests.unit.test_gguf_kquant import random_blocks

pytestmark = pytest.mark.skipif(not invariant.available(), reason="needs a CPU with AVX-512 BF16 (or AMX)")

# The kernel's two arithmetics: AVX-512 BF16 dot products everywhere it builds, AMX tiles where the
# CPU has them (w8a8 is AMX only: without it the layer keeps FBGEMM's exact int8 sums).
ARITHMETICS = ["avx512", pytest.param("amx", marks=pytest.mark.skipif(
    not invariant.cpu_has_amx(), reason="the AMX arithmetic needs a CPU with AMX"))]


@pytest.fixture(params=ARITHMETICS)
def arithmetic(request):
    invariant.set_arithmetic(0 if request.param == "avx512" else 1)
    yield request.param
    invariant.set_arithmetic(-1)

N, K = 80, 256  # N not a multiple of 32 (padded columns); K a whole number of K-quant super-blocks
ROW_COUNTS = [*range(1, 65), 100, 256, 300]  # decode batches and prefill-sized calls
DTYPES = [torch.bfloat16, torch.float32]
# Relative precision of the kernel against float64 on the dequantized weight, per activation dtype:
# bf16 rounds W (2^-9) and the output (2^-9); float32 carries x and W as bf16 pairs (~2^-16 each).
PRECISION = {torch.bfloat16: 2**-7, torch.float32: 2**-14}


def _weight(seed: int = 0) -> torch.Tensor:
    return torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05


def _gguf_blocks(qtype: Q) -> np.ndarray:
    w = np.random.default_rng(3).standard_normal((N, K)).astype(np.float32) * 0.05
    return gguf.quants.quantize(w, qtype)


LAYERS = {
    "int8": lambda: Int8Linear.from_float(_weight()),
    "int4-g32": lambda: Int4Linear.from_float(_weight(), 32),
    "int4-g128": lambda: Int4Linear.from_float(_weight(), 128),
    "w8a8": lambda: W8A8Linear.from_float(_weight()),
    "gguf-q8_0": lambda: Q8_0Linear(*decode_q8_0(_gguf_blocks(Q.Q8_0), N)),
    "gguf-q4_1": lambda: Int4Linear.from_codes(*_q4_1_parts(), group_size=32),
    "gguf-q6_k": lambda: GGUFBlockLinear(torch.from_numpy(random_blocks(Q.Q6_K, N, K, seed=3)), Q.Q6_K),
    "gguf-q5_0": lambda: GGUFBlockLinear(torch.from_numpy(_gguf_blocks(Q.Q5_0)), Q.Q5_0),
    "gguf-q4_k": lambda: GGUFBlockLinear(torch.from_numpy(random_blocks(Q.Q4_K, N, K, seed=4)), Q.Q4_K),
}


def _q4_1_parts():
    codes, d, m = decode_q4_1(_gguf_blocks(Q.Q4_1), N)
    return codes, d, m + 8 * d


def _activations(dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(max(ROW_COUNTS), K, generator=torch.Generator().manual_seed(7))
    x[5, 3] = 8.0  # an outlier channel
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", LAYERS)
def test_a_row_does_not_depend_on_the_rows_beside_it(name, dtype, arithmetic):
    if name == "w8a8" and (arithmetic != "amx" or not invariant.w8a8_enabled()):
        pytest.skip("the w8a8 kernel is AMX int8 only")
    layer = LAYERS[name]()
    assert layer.kernels == ("invariant",) and all(layer.select_kernel(m) == "invariant" for m in (1, 9, 300))
    x = _activations(dtype)
    alone = layer(x[:1])[0]
    for m in ROW_COUNTS:
        assert torch.equal(layer(x[:m])[0], alone), f"row 0 differs at M = {m}"
    # Every row of a decode-sized call (on AMX, <= 32 rows take their own loop: rows 16-31 in a
    # second row tile) equals the same row in a prefill-sized call.
    assert torch.equal(layer(x[:32]), layer(x[:300])[:32])
    # Every row of the smallest calls too (without AMX, up to 3 or 4 rows take a loop of their own).
    for m in range(1, 6):
        assert torch.equal(layer(x[:m]), layer(x[:300])[:m]), f"a row of M = {m} differs"
    # And a row's result does not depend on where it sits or what its neighbours hold.
    shuffled = x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1))]
    at = int((shuffled == x[0]).all(dim=1).nonzero()[0])
    assert torch.equal(layer(shuffled[: max(at + 1, 17)])[at], alone)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", [n for n in LAYERS if n != "w8a8"])
def test_weight_only_kernel_equals_float64_on_the_dequantized_weight(name, dtype, arithmetic):
    layer = LAYERS[name]()
    w = layer.dequantize().double()
    x = _activations(dtype)[:33]
    want = x.double() @ w.t()
    err = (layer(x).double() - want).abs()
    scale = x.double().abs() @ w.abs().t()
    assert (err <= PRECISION[dtype] * scale + 1e-12).all(), f"max error / scale {(err / scale).max():.2e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_w8a8_integer_sums_are_exact(dtype):
    layer = W8A8Linear.from_float(_weight())
    x = _activations(dtype)[:40]
    qx, sx = quantize_per_token(x)
    sums = qx.long() @ layer.codes().long().t()  # exact in int64
    want = (sums.float() * (sx * layer.scale)).to(dtype)
    assert torch.equal(layer(x), want)


def test_tile_layouts_round_trip():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (70, 100), dtype=torch.int8, generator=g)
    assert torch.equal(invariant.unpack_tiles(invariant.pack_tiles(q), 70, 100), q)
    assert torch.equal(invariant.unpack_tiles(invariant.pack_tiles(q, group=4), 70, 100), q)
    ids = torch.tensor([0, 15, 16, 69])
    assert torch.equal(invariant.tile_rows(invariant.pack_tiles(q), ids, 100), q[ids])
    codes = torch.randint(0, 16, (70, 128), dtype=torch.uint8, generator=g)
    packed = invariant.pack_nibbles(codes)
    assert torch.equal(invariant.unpack_nibbles(packed, 70, 128), codes)
    assert torch.equal(invariant.nibble_rows(packed, ids, 128), codes[ids])
    v = torch.randn(70, 4, generator=g)
    assert torch.equal(invariant.unpack_blocks(invariant.pack_blocks(v), 70), v)


# ---- engine level: a request alone == in a batch == on a prefix-cache hit --------------------------

PROMPT = list(range(40, 88))  # 48 tokens: three 16-token blocks
OTHERS = [[(7 * i + j) % 250 + 3 for j in range(5 + 9 * i)] for i in range(7)]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)


def _run(engine: LLMEngine, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
    base = f"r{engine.stats().prompt_tokens_total}-"
    for i, p in enumerate(prompts):
        engine.add_request(f"{base}{i}", p, PARAMS)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].logprobs)
    return [done[f"{base}{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("method", ["int8", "int4", "w8a8", "gguf"])
def test_a_request_alone_in_a_batch_and_from_the_prefix_cache_is_identical(tiny_model_dir, tmp_path, method, dtype):
    model = tiny_model_dir
    if method == "gguf":  # Q4_1 layers, a Q8_0 lm_head: the default model's mix
        model = write_gguf_from_hf_dir(tiny_model_dir, tmp_path / "tiny-q4_1.gguf", qtype=Q.Q4_1)

    def engine(**kw) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(model), dtype=dtype, quantization=method,
                                      quantize_lm_head=True, kv_cache_memory=32 << 20, **kw))

    alone = _run(engine(enable_prefix_caching=False), [PROMPT])[0]
    in_batch = _run(engine(enable_prefix_caching=False, max_num_batched_tokens=64), OTHERS[:3] + [PROMPT] + OTHERS[3:])[3]
    cached = engine(enable_prefix_caching=True)
    _run(cached, [PROMPT[:40] + [1, 2, 3]])  # leaves the prompt's first two blocks in the cache
    hits = cached.stats().prefix_cache_hits
    from_cache = _run(cached, [PROMPT])[0]
    assert cached.stats().prefix_cache_hits > hits, "the second prompt is meant to hit the prefix cache"
    for name, got in (("in a batch", in_batch), ("from the prefix cache", from_cache)):
        assert got[0] == alone[0], f"{method} {dtype}: tokens differ {name}"
        assert got[1] == alone[1], f"{method} {dtype}: logprobs differ {name}"
