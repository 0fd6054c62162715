"""The lm_head's column maxima (linear_bf16_maxima) and the sampler's use of them: every 16 logits'
maximum is exactly the maximum of the logits linear_bf16 stores (NaN where one of them is NaN), on
both bf16 arithmetics; the top-k / top-p draw gives the same tokens with them as without (a hint
with NaN or zero chunks falls back to the logits); the runner hands them only for the logits they
were made with."""

from __future__ import annotations

import pytest
import torch

from tessera import kernels
from tessera.engine import candidates
from tessera.kernels import linear
from tests.unit.test_sampler_candidates import mixed_filters

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the C++ kernels did not build here")

ARITHMETICS = [pytest.param(0, id="avx512", marks=pytest.mark.skipif(
                   not kernels.cpu_has_avx512_bf16(), reason="needs AVX-512 BF16")),
               pytest.param(1, id="amx", marks=pytest.mark.skipif(
                   not kernels.cpu_has_amx_bf16(), reason="needs AMX bf16"))]


def _block_maxima(logits: torch.Tensor) -> torch.Tensor:
    """Each row's maximum of every 16 columns (the last block short), NaN where a block holds one."""
    pad = -logits.shape[1] % 16
    blocks = torch.nn.functional.pad(logits, (0, pad), value=float("-inf")).view(logits.shape[0], -1, 16)
    return torch.where(blocks.isnan().any(-1), torch.full_like(blocks[..., 0], float("nan")), blocks.amax(-1))


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 4099, 576), (32, 8192, 128), (7, 1000, 64), (40, 517, 96)])
def test_column_maxima_are_the_stored_logits_maxima(arithmetic, m, n, k, monkeypatch):
    monkeypatch.setattr(linear, "BF16_ARITHMETIC", arithmetic)
    g = torch.Generator().manual_seed(m * 7 + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    w[5] = float("nan")  # column 5's logits are NaN: block 0 of every row reads NaN
    lin = linear.InvariantLinear(w)
    x = torch.randn(m, k, generator=g).bfloat16()
    logits, maxima = lin.forward_float_maxima(x)
    reference = lin.forward_float(x)
    assert torch.equal(logits.nan_to_num(7.0), reference.nan_to_num(7.0))
    assert maxima.shape == (m, -(-n // 16))
    assert torch.equal(maxima.nan_to_num(7.0), _block_maxima(reference).nan_to_num(7.0))
    assert bool(maxima[:, 0].isnan().all()) and not bool(maxima[:, 1:].isnan().any())


@pytest.mark.skipif(not kernels.cpu_has_avx512_bf16(), reason="needs AVX-512 BF16 (the native sampling ops)")
@pytest.mark.parametrize("vocab", [4096, 49152])
def test_the_draw_is_the_same_with_the_maxima_as_without(vocab):
    """Same uniforms, with and without the column maxima: the same tokens; a hint with NaN blocks
    and zero chunks (which make the head pass read those chunks itself) too."""
    g = torch.Generator().manual_seed(vocab)
    rows = 6
    logits = (torch.randn(rows, vocab, generator=g) * 3).bfloat16().float()  # bf16 ties, as an lm_head gives
    logits[1, :640] = 0.0  # zero chunks: their maximum is 0, which the head pass re-reads
    temperature, top_k, top_p, min_p = mixed_filters(vocab)
    hint = _block_maxima(logits)
    odd = hint.clone()
    top = int(logits[2].argmax()) // 64 * 4
    odd[2, top:top + 4] = float("nan")  # the blocks of row 2's best chunk said to hold a NaN: read it itself
    for seed in range(30):
        u = torch.rand(rows, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        want = candidates.draw_kept(logits, temperature, top_k, top_p, min_p, u)
        assert torch.equal(candidates.draw_kept(logits, temperature, top_k, top_p, min_p, u, hint), want)
        assert torch.equal(candidates.draw_kept(logits, temperature, top_k, top_p, min_p, u, odd), want)
    if candidates._native_kept(logits, candidates.first_width(top_k, top_p, vocab)):  # else the hint is not read
        with pytest.raises(RuntimeError, match="maxima16 must be contiguous float32"):
            candidates.draw_kept(logits, temperature, top_k, top_p, min_p, u, hint[:, :-1].contiguous())
    else:
        assert vocab < 49152


@pytest.mark.skipif(not kernels.cpu_has_avx512_bf16(), reason="needs AVX-512 BF16")
def test_the_runner_hands_the_maxima_for_their_own_logits_only(tiny_model_factory):
    from tessera.config import EngineConfig
    from tessera.engine.engine import LLMEngine
    from tessera.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory()), dtype="bfloat16", max_model_len=128))
    runner = engine.runner
    seen = []
    real = engine.sampler.sample

    def sample(logits, *args, chunk_maxima=None, **kwargs):
        seen.append((logits, chunk_maxima))
        return real(logits, *args, chunk_maxima=chunk_maxima, **kwargs)

    engine.sampler.sample = sample
    engine.add_request("0", [1, 2, 3, 4], SamplingParams(max_tokens=3, temperature=0.8, top_k=20, top_p=0.9,
                                                         ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert seen and all(m is not None for _, m in seen)
    for logits, maxima in seen:
        assert torch.equal(maxima, _block_maxima(logits))
    last_logits = seen[-1][0]
    assert runner.chunk_maxima(last_logits) is not None
    assert runner.chunk_maxima(last_logits.clone()) is None  # another tensor: no hint
