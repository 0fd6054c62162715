"""The quantized kernel's logits (tessera_qgemm.qgemm_logits): fp32 holding exactly the values the
bf16 output rounds to, and each row's first maximum of them found in the store epilogue; and a
GGUF Q8_0 lm_head read from its blocks gives the bf16 kernel's logits and ids bit for bit."""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tessera import kernels
from tessera.kernels.linear import InvariantLinear
from tessera.quant import gguf_codes, invariant
from tessera.quant.gguf_kquant import GGUFBlockLinear
from tessera.quant.gguf_native import decode_q8_0
from tessera.quant.int4 import Int4Linear
from tessera.quant.int8 import Int8Linear
from tests.unit.test_gguf_kquant import random_blocks

pytestmark = pytest.mark.skipif(not (kernels.available() and invariant.available()),
                                reason="the quantized kernels need AVX-512 BF16 (AMX or not)")

# On AMX 1-32 rows take the decode loop (a second row tile from 17), more the whole-K one; without
# AMX (the AVX-512 output widened) 1-4 rows the small-row path, more the whole-K one.
ROWS = [1, 2, 4, 5, 15, 16, 17, 31, 32, 33, 50]


def _q8_0(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the bf16 weight, Q8_0 tiles, d tiles) of random Q8_0 blocks."""
    raw = random_blocks(Q.Q8_0, n, k, seed=seed)
    codes, d = decode_q8_0(raw, n)
    w = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q8_0)).bfloat16()
    return w, invariant.pack_tiles(codes), invariant.pack_blocks(d.to(torch.float16))


@pytest.mark.parametrize("m", ROWS)
def test_q8_0_logits_and_ids_are_the_bf16_kernels(m):
    n, k = 4128, 128  # n a multiple of 32 (the tiles' pairs), not of the 64 a chunk of work may hold
    w, tiles, d = _q8_0(n, k, seed=m)
    plain, coded = InvariantLinear(w), InvariantLinear(w)
    # without AMX every call from the blocks; on AMX the calls the engine sends them (up to 32 rows)
    coded.attach_q8_0(tiles, d, gguf_codes.max_rows(q8_0=True) if invariant.cpu_has_amx() else max(ROWS))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    logits, ids = coded.forward_float_argmax(x)
    want_logits, want_ids = plain.forward_float_argmax(x)
    assert torch.equal(logits, want_logits) and torch.equal(ids, want_ids)
    assert torch.equal(ids, logits.argmax(-1))  # the first maximum, as torch finds it
    assert torch.equal(coded.forward_float(x), want_logits)
    assert torch.equal(coded(x), plain(x))


def test_the_codes_are_what_small_calls_read():
    """Another weight's blocks change the logits of calls up to the row limit and of no larger one:
    the equality above is not passing because the blocks go unused."""
    w, _, _ = _q8_0(64, 64, seed=1)
    _, tiles, d = _q8_0(64, 64, seed=2)
    lin = InvariantLinear(w)
    rows = gguf_codes.max_rows(q8_0=True)
    small, large = torch.randn(rows, 64).bfloat16(), torch.randn(rows + 1, 64).bfloat16()
    before = lin.forward_float(small), lin.forward_float(large)
    lin.attach_q8_0(tiles, d, rows)
    assert not torch.equal(lin.forward_float(small), before[0])
    assert torch.equal(lin.forward_float(large), before[1])


@pytest.mark.parametrize("m", [5, 40])
def test_ties_go_to_the_first_column(m):
    # The same 96 rows of blocks three times: every maximum appears in three column pairs, which
    # two threads take in different chunks.
    raw = random_blocks(Q.Q8_0, 96, 64, seed=5)
    codes, d = decode_q8_0(raw, 96)
    codes, d = codes.repeat(3, 1), d.repeat(3, 1)
    x = torch.randn(m, 64, generator=torch.Generator().manual_seed(6)).bfloat16()
    logits, ids = invariant.qgemm_logits(x, invariant.pack_tiles(codes), invariant.pack_blocks(d.half()), None,
                                         invariant.Q8_0, 288, True)
    assert torch.equal(ids, logits.argmax(-1)) and bool((ids < 96).all())
    zero, ids0 = invariant.qgemm_logits(torch.zeros(m, 64).bfloat16(), invariant.pack_tiles(codes),
                                        invariant.pack_blocks(d.half()), None, invariant.Q8_0, 288, True)
    assert bool((zero == 0).all()) and bool((ids0 == 0).all())  # every column ties: the first


@pytest.mark.parametrize("layer", ["int8", "int4"])
@pytest.mark.parametrize("m", ROWS)
def test_other_formats_logits_widen_their_bf16_output(layer, m):
    """qgemm_logits of any format: qgemm's bf16 output widened (INT8's per-column scale applied before
    the rounding, as qgemm applies it), and torch's argmax of that."""
    w = torch.randn(200, 96, generator=torch.Generator().manual_seed(m)) * 0.05
    lin = Int8Linear.from_float(w) if layer == "int8" else Int4Linear.from_float(w, 32)
    codes, scale, zero, fmt = ((lin.tiles, lin.scale, None, invariant.INT8) if layer == "int8"
                               else (lin.tiles, lin.tile_scale, lin.tile_zero, invariant.INT4))
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m + 1)).bfloat16()
    want = invariant.qgemm(x, codes, scale, zero, fmt, 200).float()
    logits, ids = invariant.qgemm_logits(x, codes, scale, zero, fmt, 200, True)
    assert torch.equal(logits, want) and torch.equal(ids, want.argmax(-1))
    assert invariant.qgemm_logits(x, codes, scale, zero, fmt, 200, False)[1] is None


def test_float32_activations_are_refused():
    _, tiles, d = _q8_0(64, 64, seed=3)
    with pytest.raises(RuntimeError, match="bf16 x only"):
        invariant.qgemm_logits(torch.randn(2, 64), tiles, d, None, invariant.Q8_0, 64, True)


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q4_K, Q.Q5_1])
@pytest.mark.parametrize("m", [1, 17, 40])
def test_kq_blocks_logits_widen_their_bf16_output(qtype, m):
    """An lm_head of K-quant blocks (many GGUF files keep output.weight in Q6_K): the KQ kernel's
    logits and ids, against its own bf16 output widened and torch's argmax of it."""
    layer = GGUFBlockLinear(torch.from_numpy(random_blocks(qtype, 96, 256, seed=m)), qtype)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).bfloat16()
    want = layer(x).float()
    logits, ids = layer.forward_float_argmax(x)
    assert torch.equal(logits, want) and torch.equal(ids, want.argmax(-1))


@pytest.mark.parametrize("m", [3, 40])
def test_without_amx_the_other_arithmetic_is_widened(m):
    """set_arithmetic(0) (tests only; a CPU without AMX has no other): the AVX-512 output widened,
    torch's argmax of it."""
    w, tiles, d = _q8_0(256, 64, seed=m)
    x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m)).bfloat16()
    invariant.set_arithmetic(0)
    try:
        want = invariant.qgemm(x, tiles, d, None, invariant.Q8_0, 256).float()
        logits, ids = invariant.qgemm_logits(x, tiles, d, None, invariant.Q8_0, 256, True)
    finally:
        invariant.set_arithmetic(-1)
    assert torch.equal(logits, want) and torch.equal(ids, want.argmax(-1))


def test_gguf_mode_greedy_ids_from_the_lm_heads_kernel(tiny_model_factory, tmp_path, monkeypatch):
    """--quantization gguf with a Q8_0 lm_head: the engine's greedy tokens and logprobs are the
    same with the ids from the kernel's epilogue as with the sampler's own argmax of the logits."""
    from tessera.config import EngineConfig
    from tessera.engine.engine import LLMEngine
    from tessera.quant.gguf_native import Q8_0Linear, on_int8_activations
    from tests.tiny_model import write_gguf_from_hf_dir
    from tests.unit.test_gguf_codes import _generate

    if on_int8_activations():
        pytest.skip("gguf mode's Q8_0 lm_head is on int8 activations here (Q8BlocksLinear), not the bf16 tiles")

    path = write_gguf_from_hf_dir(tiny_model_factory(tie_word_embeddings=True), tmp_path / "t.gguf", qtype=Q.Q4_1,
                                  qtypes={"model.embed_tokens.weight": Q.Q8_0})
    engine = LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", quantization="gguf", max_model_len=256,
                                    enable_prefix_caching=False))
    assert isinstance(engine.runner.model.lm_head, Q8_0Linear)
    calls = []
    real = Q8_0Linear.logits_argmax

    def counted(self, x, logits=True):
        calls.append(logits)
        return real(self, x, logits)

    monkeypatch.setattr(Q8_0Linear, "logits_argmax", counted)
    fused = _generate(engine, "a")
    assert calls and all(calls)  # the kernel's ids were used; logprobs need the logits too
    monkeypatch.setattr(Q8_0Linear, "logits_argmax", lambda self, x, logits=True: None)
    assert _generate(engine, "b") == fused


def test_greedy_steps_without_logprobs_take_the_ids_alone(tiny_model_factory, tmp_path, monkeypatch):
    """Greedy requests that ask for no logprobs: the lm_head's kernel stores no logits (logits=False)
    and the tokens are those of the sampler's own argmax over the whole logits (the kernel off)."""
    from tessera.config import EngineConfig
    from tessera.engine.engine import LLMEngine
    from tessera.quant.gguf_native import Q8_0Linear, on_int8_activations
    from tessera.sampling import SamplingParams
    from tests.tiny_model import write_gguf_from_hf_dir
    from tests.unit.test_gguf_codes import PROMPTS

    if on_int8_activations():
        pytest.skip("gguf mode's Q8_0 lm_head is on int8 activations here (Q8BlocksLinear), not the bf16 tiles")

    path = write_gguf_from_hf_dir(tiny_model_factory(tie_word_embeddings=True), tmp_path / "t.gguf", qtype=Q.Q4_1,
                                  qtypes={"model.embed_tokens.weight": Q.Q8_0})
    engine = LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", quantization="gguf", max_model_len=256,
                                    enable_prefix_caching=False))
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def generate(tag: str, params: list[SamplingParams]) -> dict:
        for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=False)):
            engine.add_request(f"{tag}{i}", prompt, p)
        out = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out[o.request_id.removeprefix(tag)] = list(o.outputs[0].token_ids)
        return out

    calls = []
    real = Q8_0Linear.logits_argmax

    def counted(self, x, logits=True):
        got = real(self, x, logits)
        calls.append((logits, tuple(got[0].shape)))
        return got

    monkeypatch.setattr(Q8_0Linear, "logits_argmax", counted)
    ids_only = generate("a", [plain] * len(PROMPTS))
    assert calls and all(not logits and shape[1] == 0 for logits, shape in calls)
    # One request with logprobs in the batch: its steps store the logits again.
    calls.clear()
    mixed = generate("m", [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)]
                     + [plain] * (len(PROMPTS) - 1))
    assert any(logits for logits, _ in calls)
    monkeypatch.setattr(Q8_0Linear, "logits_argmax", lambda self, x, logits=True: None)
    assert generate("b", [plain] * len(PROMPTS)) == ids_only == mixed


@pytest.mark.parametrize("m", [1, 17, 40])
def test_ids_without_logits_are_the_ids_with_them(m):
    """logits=False stores nothing ([M, 0]) and finds the same first maxima, for Q8_0 tiles (ties
    across the column pairs the threads share out) and for K-quant blocks."""
    raw = random_blocks(Q.Q8_0, 96, 64, seed=m)
    codes, d = decode_q8_0(raw, 96)
    tiles, blocks = invariant.pack_tiles(codes.repeat(3, 1)), invariant.pack_blocks(d.repeat(3, 1).half())
    x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m)).bfloat16()
    logits, ids = invariant.qgemm_logits(x, tiles, blocks, None, invariant.Q8_0, 288, True)
    none, alone = invariant.qgemm_logits(x, tiles, blocks, None, invariant.Q8_0, 288, True, logits=False)
    assert none.shape == (m, 0) and torch.equal(alone, ids) and torch.equal(ids, logits.argmax(-1))
    layer = GGUFBlockLinear(torch.from_numpy(random_blocks(Q.Q6_K, 96, 256, seed=m)), Q.Q6_K)
    xk = torch.randn(m, 256, generator=torch.Generator().manual_seed(m + 1)).bfloat16()
    none, alone = layer.forward_float_argmax(xk, logits=False)
    assert none.shape == (m, 0) and torch.equal(alone, layer(xk).float().argmax(-1))
    with pytest.raises(RuntimeError, match="logits=False needs argmax"):
        invariant.qgemm_logits(x, tiles, blocks, None, invariant.Q8_0, 288, False, logits=False)
