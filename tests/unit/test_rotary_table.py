"""The rotary cos/sin table is the correctly rounded one, whatever ran in the process before.

Each entry is cos (sin) of the float32 angle position * inv_freq (HF's angle), computed in double
precision by Python's math library and rounded to float32 once. torch's float32 cos misses that
rounding in ~5% of entries, and once in a while gave another engine in the same process a
different table (docs/kernels.md, "Session 28"); this reference has neither problem.
"""

from __future__ import annotations

import math

import pytest
import torch

from tessera.model.layers import RotaryEmbedding


def _reference(rotary: RotaryEmbedding, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.outer(torch.arange(n, dtype=torch.float32), rotary.inv_freq).tolist()  # float32 products
    cos = torch.tensor([[math.cos(a) for a in row] for row in angles], dtype=torch.float64).float()
    sin = torch.tensor([[math.sin(a) for a in row] for row in angles], dtype=torch.float64).float()
    return cos, sin


@pytest.mark.parametrize("head_dim,theta", [(16, 10000.0), (64, 100000.0)])
def test_table_is_the_correctly_rounded_cos_and_sin(head_dim, theta):
    rotary = RotaryEmbedding(head_dim, theta, None, 300)
    cos, sin = _reference(rotary, 300)
    assert torch.equal(rotary._cos, cos)
    assert torch.equal(rotary._sin, sin)


def test_grown_table_keeps_its_rows_and_adds_correct_ones():
    rotary = RotaryEmbedding(32, 10000.0, None, 64)
    first = rotary._cos.clone()
    rotary.at(torch.tensor([200]), torch.float32)  # past the table: it grows
    assert rotary._cos.shape[0] > 200
    cos, sin = _reference(rotary, rotary._cos.shape[0])
    assert torch.equal(rotary._cos[:64], first)
    assert torch.equal(rotary._cos, cos) and torch.equal(rotary._sin, sin)
