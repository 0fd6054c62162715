"""Verification of proposed tokens: which of them the target model accepts, exactly.

A speculating sequence ran k+1 query rows through the target in one forward pass: its last
token and k proposals x_1..x_k. Row j holds the target's logits for the token after x_j (row 0:
after the last token), so p_j, the target's distribution there, is what plain decoding would
sample from if x_1..x_j had been sampled. Verification walks the rows in order:

- greedy: accept x_{j+1} while it is the argmax of row j; the first row that disagrees (or
  row k, when all were accepted) contributes its argmax. Token-identical to plain greedy.
- sampling, proposal from a distribution q_j (a draft model): accept x_{j+1} with probability
  min(1, p_j(x)/q_j(x)); at the first rejection, draw from max(0, p_j - q_j) normalized and stop;
  all accepted: draw the bonus token from p_k. The output is distributed exactly as p
  (Leviathan et al. 2023, Chen et al. 2023), whatever q is.
- sampling, deterministic proposal (n-gram lookup; q_j is a point mass on x): the rule above
  reads accept with probability p_j(x), on rejection draw from p_j with x removed. Drawing
  y_j ~ p_j and accepting iff y_j == x does exactly that, and y_j is then the very draw plain
  decoding makes. With the row's noise taken from the request's generator in the order plain
  decoding takes it, a seeded request yields the same tokens with or without speculation.

p_j is the request's own sampling distribution, built as the Sampler builds it: the min_tokens
mask on stop tokens (for the output length at row j), temperature, top-k, top-p, min-p.
Penalties and logprobs are not handled here: the engine does not speculate for such requests.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from tessera.engine.sampler import _mask_stop_tokens_before_min_tokens, exponential_race, filter_logits
from tessera.sampling import SamplingParams


@dataclass
class VerifyResult:
    token_ids: list[list[int]]  # per sequence: accepted proposals, then one token from the target
    num_accepted: list[int]  # per sequence: how many proposals were accepted


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """softmax(filter(logits / temperature)) per row, as the Sampler draws from; [R, V] float32."""
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temperature[:, None]
    filtered = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0]
    if filtered:
        rows = torch.tensor(filtered, device=device)
        new_rows = filter_logits(
            logits[rows],
            torch.tensor([params[i].top_k if params[i].top_k > 0 else vocab for i in filtered], device=device),
            torch.tensor([params[i].top_p for i in filtered], device=device),
            torch.tensor([params[i].min_p for i in filtered], device=device),
        )
        logits = logits.index_put((rows,), new_rows)
    return logits.softmax(dim=-1)


def rejection_sample(
    target: torch.Tensor,
    proposals: Sequence[int],
    draft: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """One sequence's sampling verification with the rule min(1, p/q) (see the module doc).

    target: [k+1, V] probabilities p_0..p_k; proposals: x_1..x_k; draft: [k, V] the q_j the
    proposals were drawn from, or None for a deterministic proposal (q a point mass). Returns the
    output tokens (accepted proposals + one drawn token) and the number accepted.
    """
    result = _sample_rows(lambda seqs, j: target[j : j + 1].expand(len(seqs), -1), [list(proposals)], [0],
                          [draft], [generator])
    return result[0]


def _sample_rows(
    probs_at: Callable[[list[int], int], torch.Tensor],
    proposals: Sequence[Sequence[int]],
    seqs: Sequence[int],
    drafts: Sequence[torch.Tensor | None],
    generators: Sequence[torch.Generator | None],
) -> list[tuple[list[int], int]]:
    """Sampling verification of several sequences, row by row: (tokens, accepted) per sequence.

    probs_at(seqs, j) gives p_j of each listed sequence as rows of a [len(seqs), V] tensor; it
    is asked only for the rows verification reaches (every row up to the first rejection), all
    sequences still going at depth j in one call. Building p_j is the costly part on a CPU: top-p
    sorts the whole vocabulary, and rows past a rejection are never looked at.

    Point-mass proposals (drafts[i] None) draw y_j ~ p_j with exponential_race, the Sampler's own
    draw (a seeded request: one noise key from its generator per row reached, as plain decoding
    takes them), and accept x_{j+1} iff y_j == x_{j+1}. Draft proposals are accepted when
    u_j q_j(x) < p_j(x) with u_j uniform (all k drawn first), else end with a draw from
    max(0, p_j - q_j) normalized; a sequence that accepts all k draws its last token from p_k.
    """
    out: list[tuple[list[int], int] | None] = [None] * len(proposals)
    uniforms = {i: torch.rand(len(proposals[i]), generator=generators[i], device=drafts[i].device).tolist()
                for i in seqs if drafts[i] is not None and proposals[i]}
    active = list(seqs)
    j = 0
    while active:
        probs = probs_at(active, j)
        going: list[int] = []
        point = [n for n, i in enumerate(active) if drafts[i] is None]
        if point:
            drawn = exponential_race(probs[point] if len(point) < len(active) else probs,
                                     [generators[active[n]] for n in point]).tolist()
            for n, y in zip(point, drawn, strict=True):
                i = active[n]
                if j < len(proposals[i]) and y == proposals[i][j]:
                    going.append(i)
                else:
                    out[i] = ([*proposals[i][:j], y], j)
        for n, i in enumerate(active):
            q = drafts[i]
            if q is None:
                continue
            p = probs[n]
            if j < len(proposals[i]):
                x = proposals[i][j]
                # u < p/q, written without the division; a token q gave no mass cannot have been drawn.
                if uniforms[i][j] * float(q[j, x]) < float(p[x]):
                    going.append(i)
                    continue
                residual = (p - q[j]).clamp_min_(0.0)
                if not float(residual.sum()) > 0.0:
                    residual = p  # p == q up to rounding: rejection had probability ~0
                p = residual
            y = int(exponential_race(p[None], [generators[i]])[0])
            out[i] = ([*proposals[i][:j], y], j)
        still = set(going)
        active = [i for i in active if i in still]  # in row order
        j += 1
    return [out[i] for i in seqs]


def verify(
    logits: torch.Tensor,
    proposals: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    num_output_tokens: Sequence[int],
    generators: Sequence[torch.Generator | None],
    draft_probs: Sequence[torch.Tensor | None] | None = None,
    eos_token_ids: Collection[int] = (),
) -> VerifyResult:
    """Verify a batch of speculating sequences in one go.

    logits [sum(k_i + 1), V]: sequence i's k_i + 1 rows, sequences in order. num_output_tokens[i]
    is sequence i's output length before this step (row j sees that plus j for min_tokens).
    draft_probs[i]: [k_i, V] q of a sampled draft proposal, or None (point mass / greedy).
    """
    counts = [len(p) + 1 for p in proposals]
    row_params = [p for p, c in zip(params, counts, strict=True) for _ in range(c)]
    row_outputs = [range(n + j) for n, c in zip(num_output_tokens, counts, strict=True) for j in range(c)]
    logits = _mask_stop_tokens_before_min_tokens(logits.float(), row_params, row_outputs, set(eos_token_ids))
    greedy_ids = logits.argmax(dim=-1).tolist()
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    random_seqs = [i for i, p in enumerate(params) if not p.is_greedy]
    sampled: dict[int, tuple[list[int], int]] = {}
    if random_seqs:
        def probs_at(seqs: list[int], j: int) -> torch.Tensor:
            rows = [starts[i] + j for i in seqs]
            return target_probs(logits[torch.tensor(rows, device=logits.device)], [row_params[r] for r in rows])

        drafts = [draft_probs[i] if draft_probs is not None else None for i in range(len(proposals))]
        sampled = dict(zip(random_seqs, _sample_rows(probs_at, proposals, random_seqs, drafts, generators),
                           strict=True))
    token_ids: list[list[int]] = []
    num_accepted: list[int] = []
    for i, props in enumerate(proposals):
        if i in sampled:
            tokens, m = sampled[i]
        else:
            k = len(props)
            target = greedy_ids[starts[i] : starts[i] + k + 1]
            m = 0
            while m < k and target[m] == props[m]:
                m += 1
            tokens = [*props[:m], target[m]]
        token_ids.append(tokens)
        num_accepted.append(m)
    return VerifyResult(token_ids, num_accepted)
