"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, as vLLM users know it."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence as SequenceABC
from dataclasses import fields, replace

from tqdm.auto import tqdm

from tessera.config import DEFAULT_MODEL, EngineConfig
from tessera.engine.engine import LLMEngine
from tessera.engine.openmp_team import warn_if_passive
from tessera.outputs import RequestOutput
from tessera.sampling import RequestOutputKind, SamplingParams

PromptInput = str | list[int] | dict

logger = logging.getLogger("tessera")


def _show_progress_logs() -> None:
    """Show Tessera's INFO lines (fetching, loading) when the program configured no logging:
    without it, a first `LLM()` would sit silent for seconds while it downloads and loads."""
    if logging.getLogger().handlers or logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


class LLM:
    """Generate for a batch of prompts at once; all of them share every engine step.

    Keyword arguments are EngineConfig fields (dtype, max_model_len, kv_cache_memory, block_size,
    enable_prefix_caching, max_num_seqs, max_num_batched_tokens, seed, num_threads).
    """

    def __init__(self, model: str = DEFAULT_MODEL, **engine_kwargs) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(engine_kwargs) - known
        if unknown:
            raise TypeError(f"unknown LLM argument(s) {sorted(unknown)}; known: {sorted(known - {'model'})}")
        self._start(EngineConfig(model=model, **engine_kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM for a ready EngineConfig (the CLI builds and validates one from its flags)."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        _show_progress_logs()
        logger.info("loading %s (fetched once if it is a packaged model name)", config.model)
        warn_if_passive()  # a user's setting; the disaggregated Ray workers set it on purpose
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | SequenceABC[PromptInput],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs come back in the order of `prompts`. A prompt is a string, a list of token ids,
        or {"prompt_token_ids": [...]}; one SamplingParams serves all, or give one per prompt."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompt_list)} prompts; give one, or one per prompt"
                )
        return self._run(prompt_list, params_list, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template(c), add_special_tokens=False)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, prompts: list[PromptInput], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        # Only finished outputs are returned (as vLLM's LLM asks with FINAL_ONLY): the engine then
        # builds no per-step outputs and decodes a request's text once, where no stop string needs
        # it sooner. One copy per distinct params object.
        final = {id(p): replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params}
        params = [final[id(p)] for p in params]
        try:
            for p in params:  # a constraint that does not compile is a ValueError here, as a bad prompt is
                if p.structured_outputs is not None:
                    engine.structured.compile(p.structured_outputs).result()
            for rid, prompt, p in zip(ids, prompts, params, strict=True):
                engine.add_request(rid, prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt, p)
            results: dict[str, RequestOutput] = {}
            with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm or len(ids) < 2) as bar:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            results[out.request_id] = out
                            bar.update(1)
        except BaseException:
            engine.abort_request(ids)  # nothing is left holding KV blocks, whatever went wrong
            raise
        return [results[rid] for rid in ids]


def _as_prompt_list(prompts) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts
