"""Sampler: turns one step's logits into one token per sequence, in one batched call.

Order of operations, as in vLLM:
  structured-output token mask -> penalties -> min_tokens mask -> (logprobs are taken here) -> temperature -> top-k -> top-p
  -> min-p -> draw.

Logprobs convention: the returned logprobs are `log_softmax` of the logits after penalties and
the min_tokens mask, before temperature and top-k/top-p/min-p. That is the model's own
distribution (vLLM's default "raw" logprobs, plus the penalties the request asked for), so they
do not change when a client changes temperature. Ranks are 1 + the number of tokens with a
strictly higher logprob, so tied tokens share the better rank.

Top-k and top-p never sort the whole vocabulary: tessera.engine.candidates finds each row's
kept tokens from a torch.topk fetch of its head, with exactly the semantics of `filter_logits`
(the full-sort reference, which the speculative verifier still uses). Top-p-only rows (no
top-k) on CPUs with AVX-512 or AVX2 + FMA take native ops instead (`_sample_nucleus`,
`_sample_top_p_kept`): a nucleus of thousands of tokens made that fetch widen to the whole row.

Randomness: a seeded request (a row with its own torch.Generator) draws by an exponential
race, argmax(probs / E) with E ~ Exponential(1) per token: each random step takes one key (two
31-bit integers) from its generator and E = -log(u) with u a counter-based hash of (key, token
id) (`seeded_noise`), and nothing else touches that generator, so its tokens do not depend on the
other rows in the batch or on which code path the batch took (the speculative verifier draws the
same way, so speculation does not change them). The hash instead of `vocab` draws from the
generator itself: torch's CPU generator makes about one number per 25 ns, so a 49152-token race
cost ~1.2 ms a row (40 ms a step at batch 32); the hash runs vectorized over all seeded rows.
Unseeded rows take one float64 uniform each from the shared generator and invert the CDF of their
kept tokens, which costs nothing per vocabulary entry. Greedy rows draw nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from tessera import kernels
from tessera.engine.candidates import (
    TOP_P_TOLERANCE,
    KeptPrefix,
    draw_from_prefix,
    draw_kept,
    first_argmax,
    first_width,
    head_topk,
    kept_prefix,
    native_softmax_ops,
    race_over_prefix,
)
from tessera.outputs import Logprob, TokenLogprobs
from tessera.sampling import SamplingParams
from tessera.structured.bitmask import TokenMask, apply_bitmask


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row of the batch
    logprobs: list[TokenLogprobs | None]  # None for rows whose params.logprobs is None


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
) -> torch.Tensor:
    """Return a penalized copy of `logits` [R, V]; the penalties are per-row tensors [R].

    Repetition (HF/vLLM): every token seen in the prompt or output has a positive logit divided
    by the penalty and a negative one multiplied by it. Presence and frequency (OpenAI): subtract
    `presence` once for every token in the output and `frequency` times its output count.

    Only the seen tokens change, so only they are computed (a token never seen keeps its logit
    exactly, as x / 1, x * 1 and x - 0 would give): the [R, V] formula cost ~10 passes over the
    logits, 15 ms of a 32-row step; here a copy of the logits plus work on the seen tokens.
    """
    rows, vocab = logits.shape
    device = logits.device
    out_keys, out_counts = _row_keys(output_token_ids, vocab, device).unique(return_counts=True)
    seen = torch.cat([_row_keys(prompt_token_ids, vocab, device), out_keys]).unique()  # sorted row * vocab + id
    counts = torch.zeros(seen.shape, device=device)
    counts[torch.searchsorted(seen, out_keys)] = out_counts.to(counts.dtype)
    row = seen // vocab  # index_select, not [] indexing: several times faster on CPU
    x = logits.reshape(-1).index_select(0, seen)
    scale = repetition_penalty.index_select(0, row)
    x = torch.where(x > 0, x / scale, x * scale)
    x = x - frequency_penalty.index_select(0, row) * counts - presence_penalty.index_select(0, row) * (counts > 0)
    penalized = logits.clone()
    penalized.view(-1).scatter_(0, seen, x)
    return penalized


def _row_keys(token_ids: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Every (row, token) occurrence as row * vocab + token: one flat int64 tensor. A token id
    past the logits' vocabulary (a tokenizer larger than the lm_head) has no logit to penalize:
    it is left out rather than landing on the next row's."""
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64)
    flat = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(token_ids)), lengths)
    inside = (flat >= 0) & (flat < vocab)
    return (rows[inside] * vocab + flat[inside]).to(device)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every token removed by top-k, then top-p, then min-p; per-row params [R].

    top-k keeps exactly the k largest (int64, use k >= V for off); top-p keeps the smallest
    prefix of the sorted, top-k-renormalized probabilities whose mass reaches p (1 = off);
    min-p keeps tokens with prob >= min_p * max prob (0 = off). Ties are broken toward the lower
    token id, so exactly k (or exactly the prefix) survive.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    keep = torch.arange(vocab, device=logits.device)[None, :] < top_k[:, None]
    probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    in_nucleus = (mass_before < top_p[:, None] - TOP_P_TOLERANCE) | (top_p[:, None] >= 1.0)
    in_nucleus[:, 0] = True  # the most likely token always survives, however small p is
    keep &= in_nucleus
    probs = probs.masked_fill(~keep, 0.0)
    keep &= probs >= min_p[:, None] * probs[:, :1]  # sorted, so column 0 is the max
    keep_by_token = torch.empty_like(keep).scatter_(1, order, keep)
    return logits.masked_fill(~keep_by_token, float("-inf"))


def exponential_race(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    shared_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw one token per row of `probs` [R, V] (need not be normalized): argmax(probs / E).

    Rows with a generator draw their noise from it alone; the rest share `shared_generator`
    (None = torch's default generator).
    """
    rows, vocab = probs.shape
    seeded = [i for i, gen in enumerate(generators) if gen is not None]
    if len(seeded) < rows:
        noise = _exponential_noise((rows, vocab), shared_generator, probs.device)
    else:
        noise = torch.empty_like(probs)
    if seeded:
        noise[torch.tensor(seeded, device=probs.device)] = seeded_noise([generators[i] for i in seeded], vocab,
                                                                        probs.device)
    # exponential_ can return 0; 0/0 would be NaN, which argmax treats as the maximum.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def _exponential_noise(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    if generator is None or generator.device == device:
        return torch.empty(shape, device=device).exponential_(generator=generator)
    # A generator on another device (a CPU one driving CUDA logits) draws there; the copy keeps
    # a seed's tokens the same whichever device the logits live on.
    return torch.empty(shape, device=generator.device).exponential_(generator=generator).to(device)


_MASK32 = 0xFFFFFFFF


def _mix32_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit mixer (xorshift-multiply rounds), in place on an int64 tensor holding
    32-bit values (tmp: scratch of its shape); the multipliers are below 2^31, so no product
    overflows int64. In place because each op streams the whole [rows, vocab] tensor."""
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))
    x.mul_(0x7FEB352D).bitwise_and_(_MASK32)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 15, out=tmp))
    x.mul_(0x5BD1E995).bitwise_and_(_MASK32)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))


def seeded_noise(generators: Sequence[torch.Generator], vocab: int, device: torch.device,
                 token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[len(generators), vocab] float32 Exponential(1) noise, one row per generator: each takes
    one key from its generator (two 31-bit integers, drawn on the generator's device, so a seed
    gives the same noise whichever device the logits are on), and token t's noise is -log(u),
    u = (23 bits of mix(mix(t ^ k0) ^ k1) + 0.5) / 2^23: exact integer arithmetic, so the same on
    any device and in any batch. 23 bits, not 24, so that v + 0.5 is exact in float32 and u stays
    below 1 (with 24 the top value rounded to u = 1, noise 0: a token that always won its race).
    With `token_ids` [len(generators), W] only those tokens' noise, [len(generators), W]: the
    race over a kept prefix needs no other (the same values as the full row's, gathered)."""
    keys = torch.stack([torch.randint(0, 2**31 - 1, (2,), generator=gen, dtype=torch.int64,
                                      device=gen.device).to(device) for gen in generators])
    if device.type == "cpu" and kernels.sampling_ops(torch.empty(0)) and _NATIVE_HASH:
        # The same integers in one native pass (tessera/kernels/csrc/sampling.cpp: seeded_uniforms).
        u = kernels.ops().seeded_uniforms(keys, token_ids, vocab)
    else:
        u = _hashed_uniforms(keys, vocab, device, token_ids)
    return u.log_().neg_()


# Whether seeded_noise takes the native hash where it can (tests turn it off to compare).
_NATIVE_HASH = True


def _hashed_uniforms(keys: torch.Tensor, vocab: int, device: torch.device, token_ids: torch.Tensor | None) -> torch.Tensor:
    """seeded_noise's uniforms in torch int64 ops (every device)."""
    ids = torch.arange(vocab, dtype=torch.int64, device=device)[None, :] if token_ids is None else token_ids
    x = ids ^ keys[:, :1]
    tmp = torch.empty_like(x)
    step = max(1, _HASH_CHUNK // max(x.shape[1], 1))  # rows per pass: their int64 state stays in L2
    for r in range(0, keys.shape[0], step):
        rows, scratch = x[r : r + step], tmp[r : r + step]
        _mix32_(rows, scratch).bitwise_xor_(keys[r : r + step, 1:])
        _mix32_(rows, scratch).bitwise_right_shift_(9)
    return x.to(torch.float32).add_(0.5).mul_(1.0 / (1 << 23))


# seeded_noise hashes this many tokens per pass (int64 state and scratch: 1.5 MiB).
_HASH_CHUNK = 1 << 17


@dataclass
class _RowFilters:
    """One batch's per-row sampling tensors and groups, made from its SamplingParams objects and
    reused while the next call passes the same objects (the engine's running batch does from step
    to step): the tensor builds and the loops over the rows were ~0.1 ms of a 32-row step, run with
    the caches cold after the model's forward. Requests never change their params."""

    params: tuple[SamplingParams, ...]
    seeded: tuple[bool, ...]
    vocab: int
    device: torch.device
    native: bool  # native_softmax_ops: where top-p-only rows take the native nucleus
    temperature: torch.Tensor
    groups: dict[str, list[int]]  # nucleus, top_p_kept, filtered, plain -> rows
    filters: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # top_k (vocab = off), top_p, min_p
    width: int  # draw_kept's first fetch for these rows
    unit_norm: tuple[torch.Tensor, torch.Tensor] | None  # draw_kept's row normalizers where no row needs them

    def fits(self, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None], vocab: int,
             device: torch.device, native: bool) -> bool:
        return (vocab == self.vocab and device == self.device and native == self.native
                and len(params) == len(self.params) == len(generators)
                and all(a is b for a, b in zip(params, self.params, strict=True))
                and all((g is not None) == s for g, s in zip(generators, self.seeded, strict=True)))


class Sampler:
    """Samples one token for every row of a step's logits. Holds no per-request state (only the
    last batch's parameter tensors, `_RowFilters`)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator  # for rows without a seed; None = torch's default
        self._rows: _RowFilters | None = None

    def _row_filters(self, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                     vocab: int, device: torch.device, native: bool) -> _RowFilters:
        if self._rows is not None and self._rows.fits(params, generators, vocab, device, native):
            return self._rows
        groups: dict[str, list[int]] = {"nucleus": [], "top_p_kept": [], "filtered": [], "plain": []}
        for i, (p, gen) in enumerate(zip(params, generators, strict=True)):
            limited = 0 < p.top_k < vocab
            if not limited and p.top_p < 1.0 and native:
                groups["nucleus" if p.min_p == 0.0 and gen is None else "top_p_kept"].append(i)
            else:
                groups["filtered" if limited or p.top_p < 1.0 else "plain"].append(i)
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        filters = (torch.tensor(top_k, device=device), torch.tensor([p.top_p for p in params], device=device),
                   torch.tensor([p.min_p for p in params], device=device))
        # No row top-p without top-k: _row_normalizers would give every row (0, 1).
        unit = all(k < vocab or p.top_p >= 1.0 for k, p in zip(top_k, params, strict=True))
        self._rows = _RowFilters(
            tuple(params), tuple(g is not None for g in generators), vocab, device, native,
            torch.tensor([p.temperature for p in params], device=device), groups, filters,
            first_width(filters[0], filters[1], vocab),
            (torch.zeros(len(params), dtype=torch.float64, device=device),
             torch.ones(len(params), dtype=torch.float64, device=device)) if unit else None)
        return self._rows

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        eos_token_ids: Collection[int] = (),
        token_mask: TokenMask | None = None,
        argmax: torch.Tensor | None = None,
        chunk_maxima: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """One token per row of `logits` [B, V]; every list argument has one entry per row.

        `argmax` [B]: each row's first maximum of `logits` as given, found by the lm_head's kernel
        (ModelRunner.execute_argmax); greedy rows take it when nothing below changed the logits
        (no grammar mask, penalty or min_tokens hold), saving a pass over [B, V]. Where every row
        does and none asks for logprobs (takes_argmax), `logits` is not read at all.

        `chunk_maxima` [B, ceil(V / 16)]: each row's maximum of every 16 of `logits` as given (NaN
        where one is NaN; ModelRunner.chunk_maxima); the top-k / top-p draw's head pass reads them
        instead of the whole logits where nothing below changed the logits, and gives the same tokens.

        `token_mask` (structured outputs) sets the tokens its rows' grammars forbid to -inf
        before anything else, so logprobs too are those of the constrained distribution.
        `generators[i]` is row i's own generator (seeded requests) or None for the shared one.
        `eos_token_ids` are held back, with each row's stop_token_ids, until the row has
        min_tokens output tokens (unless its params say ignore_eos).
        """
        num_rows, vocab = logits.shape
        if not len(params) == len(output_token_ids) == len(prompt_token_ids) == len(generators) == num_rows:
            raise ValueError(
                f"sample() needs one params/output/prompt/generator entry per logits row "
                f"({num_rows}), got {len(params)}/{len(output_token_ids)}/"
                f"{len(prompt_token_ids)}/{len(generators)}"
            )
        if argmax is not None and token_mask is None and self.takes_argmax(params, output_token_ids):
            # The kernel's ids are the whole sample: nothing below would read the logits (which the
            # engine then did not store: [B, 0]).
            return SamplerOutput(token_ids=argmax.tolist(), logprobs=[None] * num_rows)
        device = logits.device
        given = logits
        logits = logits.float()  # never written in place below: it may be the caller's tensor
        if token_mask is not None:
            logits = apply_bitmask(logits, token_mask.bitmask, token_mask.rows)

        penalized = {i for i, p in enumerate(params) if p.uses_penalties}
        if penalized:
            # Every row in one call, the others with no tokens (so untouched): a gather of the
            # penalized rows and a put back were two more copies of the logits.
            logits = apply_penalties(
                logits,
                [ids if i in penalized else () for i, ids in enumerate(prompt_token_ids)],
                [ids if i in penalized else () for i, ids in enumerate(output_token_ids)],
                *(
                    torch.tensor([getattr(p, name) for p in params], device=device)
                    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty")
                ),
            )
        logits = _mask_stop_tokens_before_min_tokens(logits, params, output_token_ids, set(eos_token_ids))

        wants_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wants_logprobs:
            every = len(wants_logprobs) == num_rows  # then no gathered copy of the rows first
            raw_logprobs = (logits if every else logits[torch.tensor(wants_logprobs, device=device)]).log_softmax(-1)

        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        # Every step above returns a new tensor when it changes anything: the same one means the
        # kernel's argmax is still the logits' argmax.
        greedy = argmax if argmax is not None and logits is given else None
        if not random_rows:
            token_ids = greedy if greedy is not None else first_argmax(logits)
        elif len(random_rows) == num_rows:
            token_ids = self._sample_random(logits, params, generators, chunk_maxima if logits is given else None)
        else:
            rows = torch.tensor(random_rows, device=device)
            sampled = self._sample_random(
                logits[rows], [params[i] for i in random_rows], [generators[i] for i in random_rows]
            )
            token_ids = (greedy if greedy is not None else first_argmax(logits)).index_put((rows,), sampled)

        logprobs: list[TokenLogprobs | None] = [None] * num_rows
        if wants_logprobs:
            sampled = token_ids if every else token_ids[torch.tensor(wants_logprobs, device=device)]
            counts = [params[i].logprobs for i in wants_logprobs]
            for i, entry in zip(wants_logprobs, _gather_logprobs(raw_logprobs, sampled, counts), strict=True):
                logprobs[i] = entry
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)

    @staticmethod
    def takes_argmax(params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]]) -> bool:
        """Whether sample() gives every row its logits' first maximum as given and no logprobs:
        every row greedy, without penalties, logprobs or stop tokens held back for min_tokens (a
        grammar mask is the caller's to rule out). Then the lm_head kernel's argmax is the step's
        whole sample, and its logits need not be stored at all."""
        return all(p.is_greedy and p.logprobs is None and not p.uses_penalties and len(out) >= p.min_tokens
                   for p, out in zip(params, output_token_ids, strict=True))

    def _sample_random(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        chunk_maxima: torch.Tensor | None = None,
    ) -> torch.Tensor:
        device, (num_rows, vocab) = logits.device, logits.shape
        rows = self._row_filters(params, generators, vocab, device, native_softmax_ops(logits))
        temperature, groups = rows.temperature, rows.groups
        if len(groups["filtered"]) == num_rows:  # the whole batch: the lm_head's column maxima still fit its rows
            return self._sample_filtered(logits, temperature, params, generators, chunk_maxima, rows)
        draws = {"nucleus": self._sample_nucleus, "top_p_kept": self._sample_top_p_kept,
                 "filtered": self._sample_filtered, "plain": self._sample_plain}
        for name, group in groups.items():
            if len(group) == num_rows:
                return draws[name](logits, temperature, params, generators)
        token_ids = torch.empty(num_rows, dtype=torch.long, device=device)
        for name, group in groups.items():
            if group:
                rows_of = torch.tensor(group, device=device)
                token_ids[rows_of] = draws[name](logits[rows_of], temperature[rows_of], [params[i] for i in group],
                                                 [generators[i] for i in group])
        return token_ids

    def _sample_nucleus(self, logits: torch.Tensor, temperature: torch.Tensor, params: Sequence[SamplingParams],
                        generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        """Unseeded top-p-only rows (no top-k, no min-p): the nucleus and its inverse-CDF draw in one
        native op that never orders the row (tessera/kernels/csrc/sampling.cpp: sample_top_p); the
        same kept set and draw as _sample_filtered's, which for a flat row sorted ever wider heads."""
        top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        return kernels.ops().sample_top_p(logits, temperature, top_p, self._uniforms(len(params), logits.device))

    def _sample_top_p_kept(self, logits: torch.Tensor, temperature: torch.Tensor, params: Sequence[SamplingParams],
                           generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        """Top-p-only rows that are seeded or have min-p: the same nucleus as _sample_nucleus, as a
        kept set in id order (sampling.cpp: top_p_kept), then the race or the inverse CDF over it.
        The race needs no order; the unseeded draw is the same distribution in another order."""
        device = logits.device
        ids, weights, num_kept = kernels.ops().top_p_kept(
            logits, temperature, torch.tensor([p.top_p for p in params], device=device),
            torch.tensor([p.min_p for p in params], device=device))
        return self._draw(KeptPrefix(ids, weights, num_kept), generators, logits.shape[-1], device)

    def _sample_filtered(self, logits: torch.Tensor, temperature: torch.Tensor, params: Sequence[SamplingParams],
                         generators: Sequence[torch.Generator | None], chunk_maxima: torch.Tensor | None = None,
                         rows: _RowFilters | None = None) -> torch.Tensor:
        """Rows with top-k or top-p: only the head of each row is sorted (tessera.engine.candidates);
        without seeded rows the kept tokens and the draw are one native call where it runs (draw_kept).
        `rows`: these rows' _RowFilters, where the caller has them."""
        device, vocab = logits.device, logits.shape[-1]
        if rows is not None:
            filters, hints = rows.filters, {"width": rows.width, "unit_norm": rows.unit_norm}
        else:
            filters, hints = (
                torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device),
                torch.tensor([p.top_p for p in params], device=device),
                torch.tensor([p.min_p for p in params], device=device),
            ), {}
        if all(gen is None for gen in generators):
            return draw_kept(logits, temperature, *filters, self._uniforms(len(params), device), chunk_maxima, **hints)
        return self._draw(kept_prefix(logits, temperature, *filters), generators, vocab, device)

    def _sample_plain(self, logits: torch.Tensor, temperature: torch.Tensor, params: Sequence[SamplingParams],
                      generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        """Rows with neither top-k nor top-p: the whole vocabulary (min-p, if any, masks it)."""
        device, (num_rows, vocab) = logits.device, logits.shape
        if (all(gen is None for gen in generators) and all(p.min_p == 0.0 for p in params)
                and native_softmax_ops(logits)):
            # The same inverse CDF of one shared uniform per row, in one native pass per row
            # instead of a softmax and a chunked cumsum over [rows, vocab] (tessera/kernels/csrc/sampling.cpp).
            return kernels.ops().sample_softmax(logits, temperature, self._uniforms(num_rows, device))
        probs = (logits / temperature[:, None]).softmax(dim=-1)
        min_p = [p.min_p for p in params]
        if any(m > 0.0 for m in min_p):
            floor = torch.tensor(min_p, device=device)[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        prefix = KeptPrefix(None, probs, torch.full((num_rows,), vocab, device=device))
        return self._draw(prefix, generators, vocab, device)

    def _draw(self, prefix: KeptPrefix, generators: Sequence[torch.Generator | None], vocab: int,
              device: torch.device) -> torch.Tensor:
        """Seeded rows: the exponential race on noise keyed by their own generator (see the module
        doc). The rest: the inverse CDF of one uniform each from the shared generator."""
        seeded = [i for i, gen in enumerate(generators) if gen is not None]
        if not seeded:
            return draw_from_prefix(prefix, self._uniforms(len(generators), device))
        token_ids = torch.empty(len(generators), dtype=torch.long, device=device)
        rows = torch.tensor(seeded, device=device)
        mine = prefix if len(seeded) == len(generators) else _rows_of(prefix, rows)
        noise = seeded_noise([generators[i] for i in seeded], vocab, device, mine.token_ids)
        token_ids[rows] = race_over_prefix(mine, noise)
        if len(seeded) < len(generators):
            rest = torch.tensor([i for i in range(len(generators)) if generators[i] is None], device=device)
            token_ids[rest] = draw_from_prefix(_rows_of(prefix, rest), self._uniforms(len(rest), device))
        return token_ids

    def _uniforms(self, n: int, device: torch.device) -> torch.Tensor:
        gen = self.generator
        draw_device = gen.device if gen is not None else device
        return torch.rand(n, generator=gen, dtype=torch.float64, device=draw_device).to(device)


def _rows_of(prefix: KeptPrefix, rows: torch.Tensor) -> KeptPrefix:
    ids = prefix.token_ids[rows] if prefix.token_ids is not None else None
    return KeptPrefix(ids, prefix.weights[rows], prefix.num_kept[rows])


def _mask_stop_tokens_before_min_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    eos_token_ids: set[int],
) -> torch.Tensor:
    rows: list[int] = []
    cols: list[int] = []
    vocab = logits.shape[-1]
    for i, p in enumerate(params):
        if len(output_token_ids[i]) >= p.min_tokens:
            continue
        # With ignore_eos, EOS does not end the sequence, so it need not be held back.
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids)
        ids = [t for t in stop_ids if t < vocab]
        rows += [i] * len(ids)
        cols += ids
    if not rows:
        return logits
    index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    return logits.index_put(index, torch.tensor(float("-inf"), device=logits.device))


def _gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """Per row: the sampled token's logprob and rank, then the row's top num_top[row] tokens."""
    sampled_logprob = logprobs.gather(1, sampled[:, None]).squeeze(1)
    sampled_rank = (logprobs > sampled_logprob[:, None]).sum(dim=-1) + 1
    width = min(max(num_top), logprobs.shape[-1])
    # The top entries from the row's head (head_topk: every entry above its bound, at least
    # `width` of them), then topk over the head: torch.topk over the whole row was ~1 ms of a
    # 32-row step. Among entries tied at the edge either picks some; the values are the same.
    head, head_ids, _ = head_topk(logprobs, width) if width else (logprobs[:, :0], None, None)
    top_logprob, position = head.topk(width, dim=-1)
    top_ids = head_ids.gather(1, position) if width else position
    # Rank of each top entry = 1 + entries strictly above it; all of those are in the top too.
    top_rank = (top_logprob[:, None, :] > top_logprob[:, :, None]).sum(dim=-1) + 1

    sampled, sampled_logprob, sampled_rank = sampled.tolist(), sampled_logprob.tolist(), sampled_rank.tolist()
    top_ids, top_logprob, top_rank = top_ids.tolist(), top_logprob.tolist(), top_rank.tolist()
    entries = []
    for row, n in enumerate(num_top):
        entry = {sampled[row]: Logprob(sampled_logprob[row], sampled_rank[row])}
        for j in range(min(n, width)):
            entry.setdefault(top_ids[row][j], Logprob(top_logprob[row][j], top_rank[row][j]))
        entries.append(entry)
    return entries
