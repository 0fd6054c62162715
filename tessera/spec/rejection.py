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

from collections.abc import Collection, Sequence
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
    k = len(proposals)
    if draft is None:
        return _verify_point_mass(target, proposals, generator)
    x = torch.tensor(list(proposals), device=target.device)
    rows = torch.arange(k, device=target.device)
    p_x = target[rows, x]
    q_x = draft[rows, x]
    u = torch.rand(k, generator=generator, device=target.device)
    # u < p/q, written without the division; a token q gave no mass to cannot have been drawn.
    accepted = (u * q_x < p_x).tolist()
    m = accepted.index(False) if False in accepted else k
    if m < k:
        residual = (target[m] - draft[m]).clamp_min_(0.0)
        if not float(residual.sum()) > 0.0:
            residual = target[m]  # p == q up to rounding: rejection had probability ~0
        last = int(exponential_race(residual[None], [generator])[0])
    else:
        last = int(exponential_race(target[k : k + 1], [generator])[0])
    return [*proposals[:m], last], m


def _verify_point_mass(target: torch.Tensor, proposals: Sequence[int],
                       generator: torch.Generator | None) -> tuple[list[int], int]:
    """Draw y_j ~ p_j row by row with plain decoding's noise; accept x_{j+1} iff y_j == x_{j+1}.

    A seeded generator is left exactly where plain decoding would leave it after the drawn
    tokens: one `vocab`-sized exponential draw per output token, none for the rows not reached.
    """
    k, vocab = len(proposals), target.shape[-1]
    if generator is None:
        noise = torch.empty(k + 1, vocab, device=target.device).exponential_()
        states = None
    else:
        noise = torch.empty(k + 1, vocab, device=target.device)
        states = []
        for j in range(k + 1):
            noise[j] = _row_noise(vocab, generator, target.device)
            states.append(generator.get_state())
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    drawn = (target / noise).argmax(dim=-1).tolist()
    m = 0
    while m < k and drawn[m] == proposals[m]:
        m += 1
    if states is not None:
        generator.set_state(states[m])
    return [*proposals[:m], drawn[m]], m


def _row_noise(vocab: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    # The Sampler's draw for a seeded row, number for number.
    if generator.device == device:
        return torch.empty(vocab, device=device).exponential_(generator=generator)
    return torch.empty(vocab, device=generator.device).exponential_(generator=generator).to(device)


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
    random_seqs = [i for i, p in enumerate(params) if not p.is_greedy]
    probs = None
    if random_seqs:
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in random_seqs]).to(logits.device)
        probs = target_probs(logits[rows], [row_params[r] for r in rows.tolist()])
    token_ids: list[list[int]] = []
    num_accepted: list[int] = []
    row = random_row = 0
    for i, props in enumerate(proposals):
        k = len(props)
        if params[i].is_greedy:
            target = greedy_ids[row : row + k + 1]
            m = 0
            while m < k and target[m] == props[m]:
                m += 1
            tokens = [*props[:m], target[m]]
        else:
            draft = draft_probs[i] if draft_probs is not None else None
            tokens, m = rejection_sample(probs[random_row : random_row + k + 1], props, draft, generators[i])
            random_row += k + 1
        token_ids.append(tokens)
        num_accepted.append(m)
        row += k + 1
    return VerifyResult(token_ids, num_accepted)
