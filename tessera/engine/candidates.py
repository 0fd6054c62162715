"""Top-k / top-p / min-p without sorting the vocabulary: the kept tokens of each row, exactly.

The filters keep a prefix of the row's tokens in the order (scaled logit descending, token id
ascending): top-k its first k, top-p the smallest prefix of that whose (top-k renormalized) mass
reaches p, min-p the part of it with prob >= min_p * max prob. So only the head of that order
is ever needed. `kept_prefix` fetches it with `torch.topk` (k plus a margin, or a guess for
top-p alone), re-sorts the fetched few exactly (by id, then stably by value, so ties go to the
lower id whatever order topk returned them in), and trusts only the part of it that is provably
the true head: the tokens whose value is strictly above the smallest fetched one (every token
left out is at or below it). A row whose answer reaches past that part is fetched again, wider,
up to the whole vocabulary, so the result is always the one a full stable sort would give.

Every per-row computation is elementwise or a prefix scan along the row (cumsum), and the
full-row normalizer of a top-p-only row is a softmax (reduced row by row), so a row's kept set
does not depend on which rows share its batch nor on how wide the batch's fetch was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera import kernels

# top-p compares float32 cumulative sums with p; a prefix whose mass is within this of p counts
# as reaching p, so rounding in the sum cannot pull one extra token into the nucleus.
TOP_P_TOLERANCE = 1e-6
# Extra tokens fetched past top_k, so a tie at the k-th value is usually settled in one fetch.
_TOP_K_MARGIN = 16
# First fetch for a top-p row without top-k; each refetch is this many times wider.
_TOP_P_FIRST_FETCH = 64
_GROWTH = 8


@dataclass
class KeptPrefix:
    """Per row: the fetched tokens in exact (value desc, id asc) order and how many are kept."""

    token_ids: torch.Tensor | None  # [R, W] long; None = the whole vocabulary in id order
    weights: torch.Tensor  # [R, W] float64, proportional to the probabilities; 0 past num_kept
    num_kept: torch.Tensor  # [R] long, >= 1


def kept_prefix(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor) -> KeptPrefix:
    """The tokens each row of `logits` [R, V] keeps after temperature, top-k, top-p and min-p.

    top_k: int64 [R], V = off; top_p: [R], 1 = off; min_p: [R], 0 = off; temperature > 0.
    Same semantics as tessera.engine.sampler.filter_logits (the sorting reference).
    """
    rows, vocab = logits.shape
    width = first_width(top_k, top_p, vocab)
    norm = _row_normalizers(logits, temperature, (top_k >= vocab) & (top_p < 1.0))
    result = _kept_within(logits, temperature, top_k, top_p, min_p, width, norm)
    exact, prefix = result
    while not bool(exact.all()):
        width = min(vocab, width * _GROWTH)
        redo = torch.nonzero(~exact).flatten()
        exact_redo, again = _kept_within(logits[redo], temperature[redo], top_k[redo], top_p[redo],
                                         min_p[redo], width, (norm[0][redo], norm[1][redo]))
        prefix = _merge(prefix, again, redo)
        exact = exact.clone()
        exact[redo] = exact_redo
    return prefix


def _row_normalizers(logits: torch.Tensor, temperature: torch.Tensor,
                     rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, sum) [R] in float64 of each selected row's tempered logits: a fetched token's share
    of the whole row is exp(s - max) / sum, the softmax a top-p-only nucleus is measured against,
    computed once per call instead of once per fetch (a wider refetch used to redo the float64
    softmax of the whole row). The terms are float32 exps (each within 2^-24 of the float64 one),
    summed in float32 eight at a time (7 roundings: within 7 * 2^-24) and those sums in float64:
    all terms are positive, so the total is within 5e-7 of the float64 softmax's, inside
    TOP_P_TOLERANCE; a float32 sum of the whole row would not be (thousands of roundings).
    Unselected rows get (0, 1), never read."""
    mx = torch.zeros(logits.shape[0], dtype=torch.float64, device=logits.device)
    total = torch.ones_like(mx)
    if bool(rows.any()):
        picked = torch.nonzero(rows).flatten()
        every = picked.numel() == logits.shape[0]
        if native_softmax_ops(logits):
            # The same (max, sum) in one native pass per row, the exps summed in float64
            # (tessera/kernels/csrc/sampling.cpp: each term within 3e-7 of its float64 exp).
            mx[picked], total[picked] = kernels.ops().softmax_normalizers(logits if every else logits[picked],
                                                                          temperature[picked])
            return mx, total
        scaled = (logits if every else logits[picked]) / temperature[picked, None]
        top = scaled.amax(-1, keepdim=True)  # exact: the max of the float32 values
        mx[picked] = top.squeeze(1).double()
        terms = scaled.sub_(top).exp_()
        pad = -terms.shape[1] % _SUM_GROUP
        if pad:
            terms = torch.nn.functional.pad(terms, (0, pad))
        total[picked] = terms.view(terms.shape[0], -1, _SUM_GROUP).sum(-1).double().sum(-1)
    return mx, total


# _row_normalizers sums this many float32 terms before going to float64.
_SUM_GROUP = 8


def first_width(top_k: torch.Tensor, top_p: torch.Tensor, vocab: int) -> int:
    width = 0
    for k, p in zip(top_k.tolist(), top_p.tolist(), strict=True):
        width = max(width, k + _TOP_K_MARGIN if k < vocab else _TOP_P_FIRST_FETCH if p < 1.0 else 1)
    return min(vocab, width)


def _value_desc_id_asc(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The permutation of each row that sorts (value descending, id ascending), as one int64 sort:
    the float32 bits made order-preserving (negatives' magnitude bits flipped), negated, above
    the id. -0.0 is made +0.0 first (equal values must tie)."""
    bits = (values + 0.0).view(torch.int32).long()
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return ((-ordered) * (1 << 32) + ids).argsort(dim=-1)


def _kept_within(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, width: int,
                 norm: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, KeptPrefix]:
    """Kept prefixes from the `width` largest logits of each row; `exact` [R] says for which rows
    the answer lies inside the provably exact head of the fetch. norm: _row_normalizers' (max,
    sum) of the top-p-only rows."""
    rows, vocab = logits.shape
    if _native_kept(logits, width):
        # The whole of this function, row by row in the native head pass (sampling.cpp: kept_head).
        exact, ids, weights, num_kept = kernels.ops().kept_head(logits, temperature, top_k, top_p, min_p, width, *norm)
        return exact, KeptPrefix(ids, weights, num_kept)
    scaled, ids, bound = head_in_order(logits, temperature, width)
    if _native_rest(logits):
        # A fetch too wide for the native head: the rest natively all the same, so a row's weights
        # are one arithmetic whatever width its batch fetched (torch's exp and std::exp differ in
        # the last bit now and then, and a row beside it with a large top-k used to switch routes).
        exact, ids, weights, num_kept = kernels.ops().kept_in_head(scaled, ids, bound, temperature, top_k, top_p,
                                                                   min_p, vocab, *norm)
        return exact, KeptPrefix(ids, weights, num_kept)
    width = scaled.shape[1]
    positions = torch.arange(width, device=logits.device)
    if bound is not None:
        # Tokens left out of the fetch are <= bound; those strictly above it are the true head.
        exact_len = (scaled > (bound / temperature)[:, None]).sum(-1)
    else:
        exact_len = torch.full((rows,), vocab, device=logits.device)

    limited = top_k < vocab
    weights = (scaled - scaled[:, :1]).exp().double()  # exp(s - max): top-k-renormalized probs up to a scale
    num_k = torch.minimum(top_k, torch.tensor(width, device=logits.device))
    cumulative = weights.cumsum(-1)  # float64: a long nucleus sums thousands of terms
    # Mass the nucleus is measured against: the top-k mass, or for top-p alone the full row's.
    mass = cumulative.gather(1, (num_k - 1).clamp_min(0)[:, None]).squeeze(1)
    top_p_only = ~limited & (top_p < 1.0)
    if bool(top_p_only.any()):
        # The nucleus is measured against the whole row's mass: the fetched tokens' float64 softmax
        # over the whole row (a nucleus of thousands of tokens is summed; float32 rounding would
        # move its edge), from the row's max and sum taken once (_row_normalizers).
        rows_p = torch.nonzero(top_p_only).flatten()
        mx, total = norm
        full_probs = (scaled[rows_p].double() - mx[rows_p, None]).exp_() / total[rows_p, None]
        weights = weights.index_put((rows_p,), full_probs)
        cumulative = weights.cumsum(-1)
        mass = mass.index_put((rows_p,), torch.ones(len(rows_p), device=logits.device, dtype=mass.dtype))
    mass_before = (cumulative - weights) / mass[:, None]
    in_nucleus = (mass_before < top_p[:, None] - TOP_P_TOLERANCE) | (top_p[:, None] >= 1.0)
    in_nucleus[:, 0] = True  # the most likely token always survives, however small p is
    keep = in_nucleus & (positions[None, :] < num_k[:, None])
    keep &= weights >= min_p[:, None] * weights[:, :1]
    num_kept = keep.sum(-1).clamp_min(1)  # keep is a prefix: every test is monotone along the row
    # The answer must lie inside the exact head, one position past it decided there too.
    nucleus_len = in_nucleus.sum(-1)
    exact = exact_len >= vocab
    exact |= limited & (top_k <= exact_len)
    closes = (top_p < 1.0) & (nucleus_len < exact_len)  # the nucleus ended inside the head
    exact |= ~limited & ((top_p >= 1.0) | closes)
    weights = weights.masked_fill(positions[None, :] >= num_kept[:, None], 0.0)
    return exact, KeptPrefix(ids, weights, num_kept)


def head_in_order(logits: torch.Tensor, temperature: torch.Tensor,
                  width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """head_topk(logits, width)'s entries divided by each row's temperature, in (quotient
    descending, id ascending) order: (scaled, ids, bound). On CPU the native pass returns them
    so; elsewhere one int64 sort orders them (_value_desc_id_asc)."""
    if _native_head(logits, width):
        return tuple(kernels.ops().head_topk(logits, width, temperature))
    values, ids, bound = head_topk(logits, width)
    scaled = values / temperature[:, None]
    order = _value_desc_id_asc(scaled, ids)
    return scaled.gather(1, order), ids.gather(1, order), bound


def _native_head(x: torch.Tensor, width: int) -> bool:
    """Whether head_topk takes the native pass for this fetch (the torch routes stay for a whole
    row, a fetch too wide for chunking, and tensors off the CPU)."""
    return width * _TOPK_CHUNK * 4 <= x.shape[1] and _native_ops_for(x)


def _native_ops_for(x: torch.Tensor) -> bool:
    """Whether the native sampling ops are built and take these logits (CPU float32)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and kernels.available()


def native_softmax_ops(logits: torch.Tensor) -> bool:
    """Whether the native softmax ops (sample_softmax, softmax_normalizers in
    tessera/kernels/csrc/sampling.cpp) can take these logits: CPU float32, the native kernels
    built, AVX2 + FMA (kernels.sampling_ops)."""
    return logits.device.type == "cpu" and kernels.sampling_ops(logits)


def _native_kept(x: torch.Tensor, width: int) -> bool:
    """Whether _kept_within runs natively (kept_head): wherever its head does (tests compare the
    two over the same head by turning this and _native_rest off)."""
    return _native_head(x, width)


def _native_rest(x: torch.Tensor) -> bool:
    """Whether _kept_within's part after the head runs natively (kept_in_head) for a head the torch
    route fetched: wherever the native ops are built for these logits."""
    return _native_ops_for(x)


# head_topk's chunk count per row is vocab / _TOPK_CHUNK.
_TOPK_CHUNK = 64


def head_topk(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """At least `width` entries of each row of x [R, V]: (values, ids, bound), padded with -inf
    values (ids 0), such that every entry left out is <= bound[row] and every entry above
    bound[row] is taken. bound is None when the whole row is taken.

    torch.topk is a scalar partial sort on CPU (about 5-10 ms for 32 x 49152 at k = 66). Here
    the row is cut into strided chunks (entry i in chunk i % num_chunks), whose maxima one
    vectorized amax finds; the bound is the width-th largest chunk maximum, so at least `width`
    entries (those maxima) reach it, and an entry above it must sit in one of the chosen chunks
    (any other chunk's maximum is <= the bound). The chosen chunks' entries >= bound are taken.
    """
    rows, vocab = x.shape
    if width >= vocab:
        return x, torch.arange(vocab, device=x.device).expand(rows, vocab), None
    if width * _TOPK_CHUNK * 4 > vocab:
        values, ids = x.topk(width, dim=-1, sorted=False)
        return values, ids, values.amin(-1)
    if _native_head(x, width):
        # The same contract in one native pass (contiguous chunks; tessera/kernels/csrc/sampling.cpp).
        return tuple(kernels.ops().head_topk(x, width))
    num_chunks = -(-vocab // _TOPK_CHUNK)
    if num_chunks * _TOPK_CHUNK != vocab:
        x = torch.nn.functional.pad(x, (0, num_chunks * _TOPK_CHUNK - vocab), value=float("-inf"))
    chunks = x.view(rows, _TOPK_CHUNK, num_chunks)  # chunks[r, :, c] is chunk c
    chunk_max, chosen = chunks.amax(1).topk(width, dim=-1, sorted=False)
    bound = chunk_max.amin(-1)
    picked = chunks.gather(2, chosen[:, None, :].expand(rows, _TOPK_CHUNK, width)).reshape(rows, -1)
    take = picked >= bound[:, None]
    counts = take.sum(-1)
    # Pack each row's taken entries to the left of a [R, max count] buffer.
    row, col = take.nonzero(as_tuple=True)
    starts = counts.cumsum(0) - counts
    slot = torch.arange(row.numel(), device=x.device) - starts[row]
    width_out = int(counts.max())
    values = torch.full((rows, width_out), float("-inf"), device=x.device, dtype=x.dtype)
    ids = torch.zeros((rows, width_out), dtype=torch.long, device=x.device)
    values[row, slot] = picked[row, col]
    position = col // width  # picked[r] is [_TOPK_CHUNK, width] flattened: (offset in chunk, chosen index)
    ids[row, slot] = (position * num_chunks + chosen[row, col % width]).clamp_max_(vocab - 1)
    return values, ids, bound


def _merge(prefix: KeptPrefix, again: KeptPrefix, rows: torch.Tensor) -> KeptPrefix:
    """prefix with `rows` replaced by the wider `again` (narrower rows padded with weight 0)."""
    width = max(prefix.token_ids.shape[1], again.token_ids.shape[1])

    def pad(t: torch.Tensor, value) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    ids, weights = pad(prefix.token_ids, 0), pad(prefix.weights, 0.0)
    ids[rows] = pad(again.token_ids, 0)
    weights[rows] = pad(again.weights, 0.0)
    num_kept = prefix.num_kept.clone()
    num_kept[rows] = again.num_kept
    return KeptPrefix(ids, weights, num_kept)


def draw_from_prefix(prefix: KeptPrefix, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row, token j of the kept prefix with probability weights[j] / sum: the
    inverse CDF of `uniforms` [R] (float64 in [0, 1)) over the float64 cumulative weights."""
    weights = prefix.weights
    if weights.shape[1] > 4 * _CDF_CHUNK:
        position = _chunked_inverse_cdf(weights, uniforms)
    else:
        position = _inverse_cdf(weights.double().cumsum(-1), uniforms[:, None])
    if prefix.token_ids is None:
        return position.squeeze(1)
    return prefix.token_ids.gather(1, position).squeeze(1)


def draw_kept(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              min_p: torch.Tensor, uniforms: torch.Tensor, chunk_maxima: torch.Tensor | None = None, *,
              width: int | None = None, unit_norm: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """draw_from_prefix(kept_prefix(logits, ...), uniforms): one token per row, drawn from its kept
    tokens by the inverse CDF of its uniform. Where the native head takes the first fetch, the kept
    prefix and the draw are one call (sampling.cpp: draw_kept_head) for every row whose answer lies
    in that fetch, and only the others go through kept_prefix's wider fetches.

    A row's token is the one draw_from_prefix gives over that row's kept prefix alone. (A batch's
    prefix is padded with zero weights to its widest row, which changes no sum; only a batch
    padded past 4 * _CDF_CHUNK took the chunked sums, whose float32 rounding differs.)

    `chunk_maxima` [R, ceil(V / 16)] (optional): each row's maximum of every 16 logits, NaN where one
    is NaN, as the lm_head's kernel found them (ModelRunner.chunk_maxima). The native head pass then
    reads those instead of every logit for its chunk maxima: the same head, so the same tokens.

    Where the caller knows them from the rows' parameters (the sampler's _RowFilters): `width`, the
    first fetch (first_width of top_k, top_p), and `unit_norm`, the (0, 1) float64 [R] pair
    _row_normalizers gives when no row is top-p without top-k."""
    vocab = logits.shape[1]
    if width is None:
        width = first_width(top_k, top_p, vocab)
    if not _native_kept(logits, width):
        return draw_from_prefix(kept_prefix(logits, temperature, top_k, top_p, min_p), uniforms)
    norm = unit_norm or _row_normalizers(logits, temperature, (top_k >= vocab) & (top_p < 1.0))
    tokens = kernels.ops().draw_kept_head(logits, temperature, top_k, top_p, min_p, width, *norm, uniforms,
                                          chunk_maxima)
    redo = torch.nonzero(tokens < 0).flatten()
    if redo.numel():
        prefix = kept_prefix(logits[redo], temperature[redo], top_k[redo], top_p[redo], min_p[redo])
        tokens[redo] = draw_from_prefix(prefix, uniforms[redo])
    return tokens


def _inverse_cdf(cdf: torch.Tensor, target_fraction: torch.Tensor) -> torch.Tensor:
    """[R, 1] positions: the first whose cdf exceeds target_fraction * total, always one with
    weight > 0 (the target is kept below the total)."""
    total = cdf[:, -1:]
    target = torch.minimum(target_fraction * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp_max_(cdf.shape[1] - 1)


# The whole-vocabulary draw sums weights in chunks of this many: a float64 cumsum over the chunk
# sums, then over one chunk, instead of a sequential float64 cumsum of the whole row.
_CDF_CHUNK = 256


def _chunked_inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """_inverse_cdf over a wide row in two levels (the chunk, then the entry inside it): the same
    distribution, in O(V) vectorized work plus O(V / chunk) sequential."""
    rows, width = weights.shape
    num_chunks = -(-width // _CDF_CHUNK)
    if num_chunks * _CDF_CHUNK != width:
        weights = torch.nn.functional.pad(weights, (0, num_chunks * _CDF_CHUNK - width))
    chunks = weights.view(rows, num_chunks, _CDF_CHUNK)
    sums = chunks.sum(-1).double()  # float32 over 256 entries, then float64 across chunks
    cdf = sums.cumsum(-1)
    chunk = _inverse_cdf(cdf, uniforms[:, None])  # a chunk with mass > 0
    total = cdf[:, -1:]
    before = cdf.gather(1, chunk) - sums.gather(1, chunk)
    starts = torch.arange(rows, device=weights.device)[:, None] * (num_chunks * _CDF_CHUNK) + chunk * _CDF_CHUNK
    inside = weights.reshape(-1)[starts + torch.arange(_CDF_CHUNK, device=weights.device)].double().cumsum(-1)
    # What is left of the target inside the chunk, as a fraction of the chunk's own cumsum (whose
    # rounding differs from the chunk sum's: _inverse_cdf keeps the target below its total).
    left = (uniforms[:, None] * total - before).clamp_min_(0.0) / inside[:, -1:]
    position = _inverse_cdf(inside, left.clamp_max_(1.0))
    return (chunk * _CDF_CHUNK + position).clamp_max_(width - 1)


def race_over_prefix(prefix: KeptPrefix, noise: torch.Tensor) -> torch.Tensor:
    """The exponential race of the sampler's seeded rows, over the kept tokens only:
    argmax(weight / noise) where noise is the rows' Exponential(1) noise at the prefix's tokens
    ([R, W], seeded_noise with the prefix's token ids; [R, V] when the prefix is the whole
    vocabulary). The tokens outside the prefix have probability 0, so they could never win the
    full race."""
    # seeded_noise is never 0 (its u stays below 1), so no clamp; the ratio is written over the
    # noise (a full row's is 6 MB at 32 x 49152: every fresh buffer costs its page faults).
    ratio = torch.div(prefix.weights, noise, out=noise) if noise.dtype == prefix.weights.dtype else prefix.weights / noise
    if prefix.token_ids is None:
        return first_argmax(ratio)
    return prefix.token_ids.gather(1, ratio.argmax(-1, keepdim=True)).squeeze(1)


# Chunk width of first_argmax: a row's maximum is found with vectorized amax over chunks, then
# torch.argmax (a scalar loop on CPU, several times slower than amax) runs on one chunk only.
_ARGMAX_CHUNK = 256


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for a 2-D float tensor (the first index of each row's maximum),
    with one vectorized pass over the row instead of argmax's scalar one."""
    rows, width = x.shape
    if width <= 2 * _ARGMAX_CHUNK:
        return x.argmax(dim=-1)
    num_full = width // _ARGMAX_CHUNK
    chunk_max = x[:, : num_full * _ARGMAX_CHUNK].reshape(rows, num_full, _ARGMAX_CHUNK).amax(-1)
    if num_full * _ARGMAX_CHUNK < width:
        chunk_max = torch.cat([chunk_max, x[:, num_full * _ARGMAX_CHUNK:].amax(-1, keepdim=True)], dim=1)
    # The first chunk that holds the row's maximum, then the first maximum inside it.
    first_chunk = chunk_max.argmax(dim=-1)
    start = first_chunk * _ARGMAX_CHUNK
    # Positions past the row's end (a short last chunk) repeat the last entry, which comes after
    # every real position of the chunk, so argmax's first occurrence is never one of them.
    cols = (start[:, None] + torch.arange(_ARGMAX_CHUNK, device=x.device)).clamp_max_(width - 1)
    return cols.gather(1, x.gather(1, cols).argmax(dim=-1, keepdim=True)).squeeze(1)
