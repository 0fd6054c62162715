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
            res = hf_model(torch.tensor([[tok]]), past_key_values=res.past_key_values, use_cache=True)
    return out
