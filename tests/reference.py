"""Reference computations the tests compare Tessera against (transformers is the reference)."""

from __future__ import annotations

import torch


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with transformers' own KV cache and no stopping: n tokens after `prompt`."""
    out: list[int] = []
    with torch.inference_mode():
        res = hf_model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            # transformers 5 returns and takes `cache` (`past_key_values` is deprecated); 4.x the latter.
            cache = getattr(res, "cache", None)
            past = {"cache": cache} if cache is not None else {"past_key_values": res.past_key_values}
            res = hf_model(torch.tensor([[tok]]), use_cache=True, **past)
    return out
