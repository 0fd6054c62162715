"""2:4 structured sparsity (--sparsity 2:4): the pruning pattern against a naive per-group loop,
the compressed layer against a dense matmul with the pruned weight, and the model-level wiring."""

from __future__ import annotations

import pytest
import torch

from tessera.config import EngineConfig
from tessera.quant import QuantLinear, weight_memory_bytes
from tessera.quant.sparse import Sparse24Linear, prune_2_4
from tests.unit.test_quant import activations, bound, reference
from tests.unit.test_quant_model import PROMPT, load, logits


def naive_prune(w: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(w)
    for r in range(w.shape[0]):
        for g in range(0, w.shape[1], 4):
            mags = [(-abs(float(w[r, g + i])), i) for i in range(4)]  # largest first, earlier on ties
            for _, i in sorted(mags)[:2]:
                out[r, g + i] = w[r, g + i]
    return out


def weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    w[0, :8] = torch.tensor([1.0, -1.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0])  # ties, and an all-zero group
    return w


def test_pruning_is_exactly_2_of_4_largest():
    w = weight(48, 64)
    pruned = prune_2_4(w)
    assert torch.equal(pruned, naive_prune(w))
    groups = pruned.view(48, -1, 4)
    assert ((groups != 0).sum(dim=2) <= 2).all()
    assert ((groups != 0).sum(dim=2)[1:] == 2).all()  # random weights: exactly two survive


@pytest.mark.parametrize("n,k", [(48, 64), (267, 128)])
def test_compressed_layer_equals_dense_matmul_with_pruned_weight(monkeypatch, n, k):
    import tessera.quant.linear as linear

    w = weight(n, k)
    pruned = prune_2_4(w)
    layer = Sparse24Linear.from_float(w)
    assert torch.equal(layer.dequantize(), pruned)
    # Values (K/2 float32) and 4-bit index pairs (K/8 bytes) per row: 2.125 bytes a weight.
    assert layer.weight_bytes() == n * (k // 2 * 4 + k // 8)
    for tile_bytes in (linear.TILE_BYTES, 4 * k * 20):  # one tile; many uneven ones
        monkeypatch.setattr(linear, "TILE_BYTES", tile_bytes)
        for m in (1, 9, 40):
            x = activations(m, k)
            err = (layer(x).double() - reference(x, pruned)).abs()
            assert (err <= bound(x, pruned, 1e-5)).all(), (m, tile_bytes, float(err.max()))


def test_rows_must_hold_whole_groups():
    with pytest.raises(ValueError, match="multiple of 8.*without --sparsity 2:4"):
        Sparse24Linear.from_float(torch.randn(4, 12))


def test_model_with_2_4_sparsity(tiny_model_dir):
    dense = load(tiny_model_dir)
    sparse = load(tiny_model_dir, sparsity="2:4")
    layers = [m for m in sparse.modules() if isinstance(m, Sparse24Linear)]
    assert len(layers) == 4 * sparse.config.num_layers  # the lm_head only with quantize_lm_head
    assert weight_memory_bytes(sparse) < weight_memory_bytes(dense)
    # The reference: the float model with each linear weight pruned to 2:4 by hand.
    twin = load(tiny_model_dir)
    for (owner, name, _), (t_owner, _, _) in zip(_slots(sparse), _slots(twin), strict=True):
        pruned = naive_prune(getattr(t_owner, name).detach())
        setattr(t_owner, name, torch.nn.Parameter(pruned, requires_grad=False))
        assert torch.equal(getattr(owner, name).dequantize(), pruned)
    torch.testing.assert_close(logits(sparse, PROMPT), logits(twin, PROMPT), rtol=1e-4, atol=1e-4)

    int8 = load(tiny_model_dir, "int8", sparsity="2:4")  # pruned, then quantized: zeros stay zeros
    for owner, name, _ in _slots(int8):
        layer = getattr(owner, name)
        assert isinstance(layer, QuantLinear)
        assert ((layer.dequantize().view(layer.out_features, -1, 4) != 0).sum(dim=2) <= 2).all()


def test_flags_and_errors():
    with pytest.raises(ValueError, match="--sparsity '1:4'"):
        EngineConfig(sparsity="1:4")
    with pytest.raises(ValueError, match="cannot be combined with --quantization gguf"):
        EngineConfig(sparsity="2:4", quantization="gguf")


def _slots(model):
    from tessera.quant.linear import linear_weight_slots

    return linear_weight_slots(model, quantize_lm_head=False)
