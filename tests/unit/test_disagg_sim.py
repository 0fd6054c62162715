"""The cluster simulator against hand-computed cases: a lone request's TTFT and ITL are exact
sums of the step-cost model; a long prompt stalls colocated decodes by its chunk steps but not
disaggregated ones, which pay the transfer once in TTFT instead."""

from __future__ import annotations

import pytest

from tessera.disagg.sim import SimRequest, StepCost, TransferCost, max_goodput_rate, simulate

COST = StepCost(base_s=0.01, per_prefill_token_s=0.001, per_decode_s=0.002)
TRANSFER = TransferCost(base_s=0.005, per_token_s=1e-5)


def test_lone_request_times_are_the_cost_model():
    (r,) = simulate([SimRequest(0.0, prompt=1000, output=4)], COST, TRANSFER, colocated_workers=1, budget=512)
    # Two chunks (512, 488), the second samples the first token; then 3 decode steps.
    t1 = 0.01 + 0.512
    t2 = t1 + 0.01 + 0.488
    assert r.token_times[0] == pytest.approx(t2)
    assert [b - a for a, b in zip(r.token_times, r.token_times[1:], strict=False)] == pytest.approx([0.012] * 3)
    (d,) = simulate([SimRequest(0.0, prompt=1000, output=4)], COST, TRANSFER, prefill_workers=1, decode_workers=1,
                    prefill_budget=2048)
    assert d.token_times[0] == pytest.approx(0.01 + 1.0)  # one chunk on the prefill worker
    # The transfer, then the decode worker's steps.
    assert d.token_times[1] == pytest.approx(1.01 + TRANSFER.transfer_s(1000) + 0.012)


def test_long_prompt_stalls_colocated_decodes_only():
    streams = [SimRequest(0.0, prompt=8, output=400) for _ in range(8)]
    workload = streams + [SimRequest(1.0, prompt=2000, output=2)]
    colo = simulate(workload, COST, TRANSFER, colocated_workers=2)
    disagg = simulate(workload, COST, TRANSFER, prefill_workers=1, decode_workers=1)
    worst_colo = max(r.max_itl for r in colo[:8])
    worst_disagg = max(r.max_itl for r in disagg[:8])
    assert worst_colo >= 0.4  # a chunk of ~500 prompt tokens lands in some stream's gap
    assert worst_disagg < 0.05  # decode steps only (8 or 9 decodes)
    assert all(len(r.token_times) == r.output for r in colo + disagg)


def test_goodput_capacity_grows_with_workers():
    one = max_goodput_rate(COST, TRANSFER, 256, 32, slo_ttft_s=2.0, slo_itl_s=0.1, duration_s=30,
                           colocated_workers=1)
    two = max_goodput_rate(COST, TRANSFER, 256, 32, slo_ttft_s=2.0, slo_itl_s=0.1, duration_s=30,
                           colocated_workers=2)
    assert two > 1.5 * one > 0
