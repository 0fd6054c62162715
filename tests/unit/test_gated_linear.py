"""The quantized kernels' gated gate_up (tessera_qgemm.qgemm_silu / kqgemm_silu): silu(gate) * up
of a fused [gate; up] weight, bit for bit silu_mul of the kernel's own output, at the decode sizes
whose epilogue computes it (1-32 rows on AMX), above them, and on the other arithmetic."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tessera import kernels
from tessera.quant import invariant
from tessera.quant.gguf_kquant import GGUFBlockLinear
from tessera.quant.gguf_tiles import KIND
from tessera.quant.int4 import Int4Linear
from tessera.quant.int8 import Int8Linear
from tests.unit.test_gguf_kquant import random_blocks

pytestmark = pytest.mark.skipif(not (kernels.available() and invariant.available()),
                                reason="the C++ kernels did not build here")

ROWS = [1, 2, 16, 17, 32, 33, 40]  # one or two row tiles of the epilogue, then the two ops in turn


def _unfused(y: torch.Tensor) -> torch.Tensor:
    return kernels.ops().silu_mul(y)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_0, Q.Q6_K, Q.Q4_K, Q.Q5_1])
@pytest.mark.parametrize("m", ROWS)
def test_kq_blocks_gated_is_silu_mul_of_their_output(qtype, m):
    n, k = 192, 256  # inter 96: six gate blocks beside six up blocks
    layer = GGUFBlockLinear(torch.from_numpy(random_blocks(qtype, n, k, seed=m)), qtype)
    t = layer.tiles
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    y = torch.ops.tessera_qgemm.kqgemm(x, t.codes, t.planes, t.sup, t.sub, KIND[qtype], n, k)
    got = torch.ops.tessera_qgemm.kqgemm_silu(x, t.codes, t.planes, t.sup, t.sub, KIND[qtype], n, k)
    assert got.shape == (m, n // 2) and torch.equal(got, _unfused(y))


@pytest.mark.parametrize("layer", ["int8", "int4", "q8_0"])
@pytest.mark.parametrize("m", ROWS)
def test_quantized_tiles_gated_is_silu_mul_of_their_output(layer, m):
    w = torch.randn(128, 96, generator=torch.Generator().manual_seed(m)) * 0.05
    if layer == "int8":
        lin = Int8Linear.from_float(w)
        args = (lin.tiles, lin.scale, None, invariant.INT8)
    elif layer == "int4":
        lin = Int4Linear.from_float(w, 32)
        args = (lin.tiles, lin.tile_scale, lin.tile_zero, invariant.INT4)
    else:
        from tests.unit.test_qgemm_logits import _q8_0
        _, tiles, d = _q8_0(128, 96, seed=m)
        args = (tiles, d, None, invariant.Q8_0)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m + 1)).bfloat16()
    y = torch.ops.tessera_qgemm.qgemm(x, *args, 128, 96)
    got = torch.ops.tessera_qgemm.qgemm_silu(x, *args, 128, 96)
    assert torch.equal(got, _unfused(y))


@pytest.mark.skipif(not invariant.cpu_has_amx(), reason="the other arithmetic is chosen by hand on AMX only")
@pytest.mark.parametrize("m", [3, 40])
def test_the_other_arithmetic_takes_the_two_ops(m):
    layer = GGUFBlockLinear(torch.from_numpy(random_blocks(Q.Q4_1, 64, 128, seed=m)), Q.Q4_1)
    t = layer.tiles
    x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m)).bfloat16()
    invariant.set_arithmetic(0)
    try:
        y = torch.ops.tessera_qgemm.kqgemm(x, t.codes, t.planes, t.sup, t.sub, KIND[Q.Q4_1], 64, 128)
        got = torch.ops.tessera_qgemm.kqgemm_silu(x, t.codes, t.planes, t.sup, t.sub, KIND[Q.Q4_1], 64, 128)
    finally:
        invariant.set_arithmetic(-1)
    assert torch.equal(got, _unfused(y))


def test_a_weight_that_is_not_two_halves_of_whole_blocks_is_refused():
    layer = GGUFBlockLinear(torch.from_numpy(random_blocks(Q.Q4_1, 48, 64, seed=1)), Q.Q4_1)
    t = layer.tiles
    with pytest.raises(RuntimeError, match="inter a multiple of 16"):
        torch.ops.tessera_qgemm.kqgemm_silu(torch.randn(2, 64).bfloat16(), t.codes, t.planes, t.sup, t.sub,
                                            KIND[Q.Q4_1], 48, 64)
