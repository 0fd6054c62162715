"""The sort-free filters (tessera.engine.candidates) against references: the kept set equals the
float64 full-sort reference on random, tied and bf16-rounded rows; head_topk keeps topk's
contract; first_argmax equals torch.argmax (first maximum); the inverse-CDF draw over a kept
prefix matches its weights (chi-square); a row's kept set does not depend on its batch."""

from __future__ import annotations

import math

import pytest
import torch

from tessera.engine.candidates import KeptPrefix, draw_from_prefix, first_argmax, head_topk, kept_prefix
from tests.unit.test_sampler import chi_square_p_value, reference_keep


def reference_kept(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> list[int]:
    """reference_keep (float64 Python, ties to the lower id) on the row's tempered softmax."""
    scaled = [x / temperature for x in row.double().tolist()]
    top = max(scaled)
    exps = [math.exp(x - top) for x in scaled]
    total = sum(exps)
    return reference_keep([e / total for e in exps], top_k, top_p, min_p)


def mixed_filters(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperature, top_k, top_p, min_p) of six rows: greedy-like top-k 1, top-k + top-p + min-p,
    top-k + top-p, top-p alone (twice, one with min-p) and top-k + min-p."""
    return (torch.tensor([1.0, 0.7, 1.3, 0.9, 0.5, 1.1]), torch.tensor([1, 7, 50, vocab, vocab, 20]),
            torch.tensor([1.0, 0.9, 0.5, 0.3, 0.97, 1.0]), torch.tensor([0.0, 0.05, 0.0, 0.0, 0.01, 0.2]))


def random_rows(seed: int, rows: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * (0.5 + 4 * seed % 5)
    if seed % 3 == 1:
        x = x.bfloat16().float()  # bf16 logits: many ties in the head
    if seed % 3 == 2:
        x = (x * 2).round() / 2  # heavy ties everywhere
    return x


@pytest.mark.parametrize("vocab", [40, 300, 8191, 49152])
@pytest.mark.parametrize("seed", range(4))
def test_kept_set_matches_the_full_sort_reference(vocab, seed):
    rows = 5
    x = random_rows(seed * 7 + vocab, rows, vocab)
    gen = torch.Generator().manual_seed(seed)
    temperature = torch.rand(rows, generator=gen) + 0.2
    top_k = torch.tensor([1, 7, 50, vocab, vocab])  # the last two rows: top-p alone
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.3, 0.97])
    min_p = torch.tensor([0.0, 0.05, 0.0, 0.0, 0.01])
    prefix = kept_prefix(x, temperature, top_k, top_p, min_p)
    for r in range(rows):
        k = int(top_k[r]) if int(top_k[r]) < vocab else -1
        want = reference_kept(x[r], float(temperature[r]), k, float(top_p[r]), float(min_p[r]))
        got = sorted(prefix.token_ids[r, : int(prefix.num_kept[r])].tolist())
        assert got == want, (r, len(got), len(want))
        assert bool((prefix.weights[r, int(prefix.num_kept[r]):] == 0).all())


def test_top_k_ties_at_the_edge_keep_the_lower_ids():
    # 300 tokens share the maximum: top-k 5 must keep ids 0..4 of them, whatever topk returns.
    vocab = 49152
    x = torch.zeros(1, vocab)
    tied = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[:300]
    x[0, tied] = 5.0
    prefix = kept_prefix(x, torch.ones(1), torch.tensor([5]), torch.ones(1), torch.zeros(1))
    assert sorted(prefix.token_ids[0, :5].tolist()) == sorted(tied.tolist())[:5]
    assert int(prefix.num_kept[0]) == 5


def test_kept_set_of_a_row_does_not_depend_on_its_batch():
    vocab = 49152
    mine = random_rows(1, 1, vocab)  # bf16-rounded: ties
    args = (torch.tensor([0.7]), torch.tensor([40]), torch.tensor([0.8]), torch.tensor([0.0]))
    alone = kept_prefix(mine, *args)
    others = random_rows(4, 6, vocab)
    batch = kept_prefix(torch.cat([others, mine]), torch.tensor([1.0] * 6 + [0.7]),
                        torch.tensor([3, 200, vocab, vocab, 64, 1, 40]), torch.tensor([1.0, 0.5, 0.9, 0.2, 1, 1, 0.8]),
                        torch.tensor([0.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0]))
    n = int(alone.num_kept[0])
    assert int(batch.num_kept[-1]) == n
    assert batch.token_ids[-1, :n].tolist() == alone.token_ids[0, :n].tolist()
    assert torch.equal(batch.weights[-1, :n], alone.weights[0, :n])


def assert_head_topk_contract(x: torch.Tensor) -> None:
    """head_topk's contract on every row of x: at least `width` distinct entries taken, with their
    values; every entry left out at most the bound; every entry above it taken."""
    vocab = x.shape[1]
    for width in (1, 17, 66):
        values, ids, bound = head_topk(x, width)
        for r in range(x.shape[0]):
            taken = ids[r][torch.isfinite(values[r])]
            assert len(set(taken.tolist())) == taken.numel() >= width
            assert torch.equal(values[r][torch.isfinite(values[r])], x[r, taken])
            left_out = torch.ones(vocab, dtype=torch.bool)
            left_out[taken] = False
            assert bool((x[r, left_out] <= bound[r]).all())
            assert set(torch.nonzero(x[r] > bound[r]).flatten().tolist()) <= set(taken.tolist())


@pytest.mark.parametrize("vocab", [100, 4096, 49152, 49153])
def test_head_topk_takes_everything_above_its_bound(vocab):
    assert_head_topk_contract(random_rows(vocab, 4, vocab))


def test_head_topk_on_rows_whose_maxima_are_signed_zeros():
    """Chunks whose maximum is +0 or -0 (the native op's exact lane-order path) keep the contract."""
    gen = torch.Generator().manual_seed(11)
    x = -torch.rand(3, 4096, generator=gen)
    x[0, ::3] = 0.0
    x[1, 5::7] = -0.0
    x[2, ::2] = 0.0
    x[2, 1::2] = -0.0
    assert_head_topk_contract(x)


@pytest.mark.parametrize("vocab", [10, 600, 49152, 49153])
def test_first_argmax_is_torch_argmax(vocab):
    for seed in range(3):
        x = random_rows(seed, 8, vocab)
        x[0] = 1.0  # all tied: the first index
        x[1, -1] = 1e9  # the maximum in a short last chunk
        assert torch.equal(first_argmax(x), x.argmax(-1))


def test_inverse_cdf_draw_follows_the_weights():
    draws = 20_000
    weights = torch.tensor([[0.5, 0.25, 0.15, 0.1, 0.0, 0.0]], dtype=torch.float64).expand(draws, -1)
    ids = torch.tensor([[7, 3, 9, 1, 4, 5]]).expand(draws, -1)
    prefix = KeptPrefix(ids, weights, torch.full((draws,), 4))
    uniforms = torch.rand(draws, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tokens = draw_from_prefix(prefix, uniforms)
    counts = torch.bincount(tokens, minlength=10)
    assert int(counts[4]) == int(counts[5]) == 0  # weight 0 is never drawn
    observed = [int(counts[t]) for t in (7, 3, 9, 1)]
    assert chi_square_p_value(observed, [draws * w for w in (0.5, 0.25, 0.15, 0.1)]) > 0.001
    # The extremes of the uniform land on the first and the last kept token.
    ends = draw_from_prefix(KeptPrefix(ids[:2], weights[:2], torch.tensor([4, 4])),
                            torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64))
    assert ends.tolist() == [7, 1]


def test_whole_vocabulary_draw_follows_the_weights():
    # A wide row takes the two-level (chunked) inverse CDF: mass spread over several chunks,
    # zeros between and at the very end, and a row length that is not a multiple of the chunk.
    draws, vocab = 20_000, 3001
    support = {5: 0.3, 255: 0.1, 256: 0.2, 1700: 0.25, 2999: 0.15}
    weights = torch.zeros(vocab, dtype=torch.float32)
    for t, w in support.items():
        weights[t] = w
    prefix = KeptPrefix(None, weights.expand(draws, -1), torch.full((draws,), vocab))
    uniforms = torch.rand(draws, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    counts = torch.bincount(draw_from_prefix(prefix, uniforms), minlength=vocab)
    assert int(counts.sum()) == sum(int(counts[t]) for t in support) == draws  # zeros never drawn
    observed = [int(counts[t]) for t in support]
    assert chi_square_p_value(observed, [draws * w for w in support.values()]) > 0.001
    ends = draw_from_prefix(KeptPrefix(None, weights.expand(2, -1), torch.tensor([vocab, vocab])),
                            torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64))
    assert ends.tolist() == [5, 2999]


@pytest.mark.parametrize("vocab", [300, 49152, 49157])
def test_row_normalizers_are_within_their_bound_of_the_float64_softmax_sum(vocab):
    # The top-p-only nucleus is measured with these (max, sum); the docstring promises the sum is
    # within 5e-7 (relative) of the float64 one, well inside TOP_P_TOLERANCE.
    from tessera.engine.candidates import _row_normalizers

    x = random_rows(vocab, 6, vocab) * 3
    temperature = torch.tensor([0.2, 0.7, 1.0, 1.5, 3.0, 0.9])
    rows = torch.tensor([True, True, True, True, True, False])
    mx, total = _row_normalizers(x, temperature, rows)
    scaled = (x / temperature[:, None]).double()
    want_max = scaled.amax(-1)
    want = (scaled - want_max[:, None]).exp().sum(-1)
    assert torch.equal(mx[:5], want_max[:5])
    assert ((total[:5] - want[:5]).abs() / want[:5]).max() < 5e-7
    assert mx[5] == 0 and total[5] == 1  # unselected rows are left alone


def test_a_top_p_only_row_keeps_the_same_weights_in_any_batch():
    # Its weights are shares of the whole row (_row_normalizers): alone, with other rows of every
    # kind, and as one of several top-p-only rows, the same bits.
    vocab = 49152
    mine = random_rows(5, 1, vocab)
    args = (torch.tensor([0.8]), torch.tensor([vocab]), torch.tensor([0.9]), torch.tensor([0.0]))
    alone = kept_prefix(mine, *args)
    n = int(alone.num_kept[0])
    for others, top_k, top_p in ((random_rows(6, 3, vocab), [5, vocab, vocab], [1.0, 0.5, 1.0]),
                                 (random_rows(7, 9, vocab), [vocab] * 9, [0.95] * 9)):
        batch = kept_prefix(torch.cat([others, mine]), torch.cat([torch.ones(len(others)), args[0]]),
                            torch.tensor([*top_k, vocab]), torch.tensor([*top_p, 0.9]), torch.zeros(len(others) + 1))
        assert int(batch.num_kept[-1]) == n
        assert batch.token_ids[-1, :n].tolist() == alone.token_ids[0, :n].tolist()
        assert torch.equal(batch.weights[-1, :n], alone.weights[0, :n])


@pytest.mark.parametrize("vocab", [4096, 49152, 49153])
def test_head_in_order_is_the_head_sorted_by_quotient_then_id(vocab):
    from tessera.engine.candidates import head_in_order

    for seed in range(3):  # random, bf16-rounded (ties) and heavily tied rows
        x = random_rows(seed * 5 + vocab, 4, vocab)
        temperature = torch.tensor([1.0, 0.7, 1.3, 0.05])
        for width in (1, 17, 66):
            scaled, ids, bound = head_in_order(x, temperature, width)
            values, want_ids, want_bound = head_topk(x, width)
            assert torch.equal(bound, want_bound)
            for r in range(4):
                kept = torch.isfinite(values[r])
                quotients = (values[r][kept] / temperature[r]).tolist()  # torch's float32 division
                want = sorted(zip(quotients, want_ids[r][kept].tolist(), strict=True), key=lambda e: (-e[0], e[1]))
                n = len(want)
                assert list(zip(scaled[r, :n].tolist(), ids[r, :n].tolist(), strict=True)) == want
                assert bool((scaled[r, n:] == float("-inf")).all())


@pytest.mark.parametrize("vocab", [4096, 49152])
def test_native_kept_head_equals_the_torch_ops(vocab, monkeypatch):
    """The native _kept_within (kept_head) against the torch ops it replaces, on random, bf16 and
    tied rows with top-k, top-k + top-p, top-p alone and min-p: the same exactness verdict, kept
    tokens and count, and weights to float32 exp rounding."""
    import tessera.engine.candidates as candidates

    if not candidates._native_head(torch.zeros(1, vocab), 17):
        pytest.skip("the native sampling ops are not built here")
    for seed in range(3):
        x = random_rows(seed * 11 + vocab, 6, vocab)
        temperature, top_k, top_p, min_p = mixed_filters(vocab)
        norm = candidates._row_normalizers(x, temperature, (top_k >= vocab) & (top_p < 1.0))
        for width in (17, 66):
            exact, got = candidates._kept_within(x, temperature, top_k, top_p, min_p, width, norm)
            monkeypatch.setattr(candidates, "_native_kept", lambda *args: False)  # torch ops, same head
            monkeypatch.setattr(candidates, "_native_rest", lambda *args: False)
            want_exact, want = candidates._kept_within(x, temperature, top_k, top_p, min_p, width, norm)
            monkeypatch.undo()
            assert torch.equal(exact, want_exact)
            assert torch.equal(got.num_kept, want.num_kept)
            for r in range(6):
                n = int(got.num_kept[r])
                assert got.token_ids[r, :n].tolist() == want.token_ids[r, :n].tolist()
                torch.testing.assert_close(got.weights[r, :n], want.weights[r, :n], rtol=1e-6, atol=0)


@pytest.mark.parametrize("vocab", [4096, 49152])
def test_draw_kept_equals_the_draw_from_the_kept_prefix(vocab):
    """draw_kept (the native kept head and draw in one call, wider fetches for the rows it hands
    back) against draw_from_prefix(kept_prefix(...)) with the same uniforms, uniforms on the
    prefix's cumulative boundaries included; each row's token also alone, outside its batch."""
    import tessera.engine.candidates as candidates
    from tessera import kernels

    if not candidates._native_kept(torch.zeros(1, vocab), 66):
        pytest.skip("the native sampling ops are not built here")
    handed_back = drawn = 0
    for seed in range(3):
        x = random_rows(seed * 13 + vocab, 6, vocab)
        temperature, top_k, top_p, min_p = mixed_filters(vocab)
        filters = (temperature, top_k, top_p, min_p)
        prefix = kept_prefix(x, *filters)
        cdf = prefix.weights.cumsum(-1)
        boundaries = (cdf / cdf[:, -1:]).clamp_max(1 - 2**-53)  # u * total lands on a cumulative sum
        uniforms = [torch.zeros(6, dtype=torch.float64), torch.full((6,), 1 - 2**-53, dtype=torch.float64)]
        uniforms += [boundaries[:, min(j, cdf.shape[1] - 1)].contiguous() for j in range(0, 60, 3)]
        uniforms += [torch.rand(6, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(20)]
        width = candidates.first_width(top_k, top_p, vocab)
        norm = candidates._row_normalizers(x, temperature, (top_k >= vocab) & (top_p < 1.0))
        for u in uniforms:
            got = candidates.draw_kept(x, *filters, u)
            assert torch.equal(got, draw_from_prefix(prefix, u))
            for r in (0, 3, 4):
                alone = candidates.draw_kept(x[r:r + 1], *(f[r:r + 1] for f in filters), u[r:r + 1])
                assert int(alone) == int(got[r])
            native = kernels.ops().draw_kept_head(x, *filters, width, *norm, u)
            handed_back += int((native < 0).sum())
            drawn += int((native >= 0).sum())
    assert handed_back > 0 and drawn > 0  # both routes ran
