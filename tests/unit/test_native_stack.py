"""The native decoder stacks (tessera/model/native_stack.py, gemma_stack.py) give bit for bit what
the module path gives: the same greedy tokens and the same logprobs, through decode batches, chunked
prefill, prefix-cache hits and speculative decoding, on Llama, Qwen2 (qkv bias), Mistral (sliding
window) and Gemma 3 shapes. The reference is the same engine with `--enforce-eager` (the modules, op by op)."""

from __future__ import annotations

import pytest
import torch

from tessera import SamplingParams, kernels
from tessera.config import EngineConfig
from tessera.engine.engine import LLMEngine
from tessera.kernels.linear import supported
from tessera.quant import invariant
from tessera.quant.gguf_native import on_int8_activations
from tests.tiny_model import write_gguf_from_hf_dir

pytestmark = pytest.mark.skipif(not (kernels.available() and kernels.fused(torch.empty(0))),
                                reason="the native stack runs on the C++ kernels (AVX-512 bf16, or AVX2 for float32)")

PROMPTS = [list(range(5, 45)), list(range(7, 12)), [3] * 60 + list(range(20, 50)), list(range(100, 133))]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)


def _dtypes() -> list[str]:
    # bf16 needs AVX-512 BF16 (or AMX) for the invariant linears; float32 takes them with --deterministic.
    return (["bfloat16"] if supported(torch.bfloat16) else []) + ["float32"]


def _run(path, dtype: str, eager: bool, **kw) -> tuple[dict, LLMEngine]:
    engine = LLMEngine(EngineConfig(model=str(path), dtype=dtype, deterministic=dtype == "float32",
                                    enforce_eager=eager, max_model_len=256, **kw))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = (o.outputs[0].token_ids, o.outputs[0].logprobs)
    return out, engine


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("shape", [
    dict(),
    dict(model_type="qwen2"),
    dict(model_type="mistral", sliding_window=24),
])
def test_native_stack_equals_modules(tiny_model_factory, dtype, shape):
    path = tiny_model_factory(**shape)
    # A small token budget splits the long prompts into chunks next to running decodes.
    native, engine = _run(path, dtype, eager=False, max_num_batched_tokens=32)
    assert engine.runner.model.native_stack is not None
    eager, engine = _run(path, dtype, eager=True, max_num_batched_tokens=32)
    assert engine.runner.model.native_stack is None
    assert native.keys() == eager.keys() == {"0", "1", "2", "3"}
    for rid in native:
        assert native[rid][0] == eager[rid][0], f"request {rid}: tokens differ"
        assert native[rid][1] == eager[rid][1], f"request {rid}: logprobs differ"


@pytest.mark.skipif(not kernels.cpu_has_avx512_bf16(), reason="Gemma's native norm needs AVX-512 BF16")
@pytest.mark.parametrize("dtype", _dtypes())
def test_gemma_stack_equals_modules(tiny_model_factory, dtype):
    """Gemma 3's stack (gemma_stack.py): four (1 + w) norms a layer and q/k norms, local layers (an
    8-token window, shorter than the prompts) around a global one with their own rotary tables,
    GeGLU; through chunked prefill beside decodes, prefix-cache hits and speculation."""
    path = tiny_model_factory(model_type="gemma3", num_layers=3)
    native, engine = _run(path, dtype, eager=False, max_num_batched_tokens=32)
    assert type(engine.runner.model.native_stack).__name__ == "GemmaStack"
    eager, engine = _run(path, dtype, eager=True, max_num_batched_tokens=32)
    assert engine.runner.model.native_stack is None
    assert native.keys() == eager.keys() == {"0", "1", "2", "3"}
    assert native == eager
    # Prefix-cache hits and n-gram speculation (several query tokens a sequence, verified) too.
    kw = dict(enable_prefix_caching=True, speculative_method="ngram", num_speculative_tokens=3)
    assert _run(path, dtype, eager=False, **kw)[0] == _run(path, dtype, eager=True, **kw)[0]


@pytest.mark.parametrize("dtype", _dtypes())
def test_native_stack_with_prefix_cache_and_speculation(tiny_model_factory, dtype):
    path = tiny_model_factory()
    kw = dict(enable_prefix_caching=True, speculative_method="ngram", num_speculative_tokens=3)
    native, _ = _run(path, dtype, eager=False, **kw)
    eager, _ = _run(path, dtype, eager=True, **kw)
    assert native == eager


def test_native_stack_forward_equals_modules_on_a_mixed_step(tiny_model_factory):
    """One model call with decodes and a prefill chunk together: the hidden states, bit for bit."""
    dtype = _dtypes()[0]
    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory()), dtype=dtype, deterministic=dtype == "float32",
                                    max_model_len=256, max_num_batched_tokens=24))
    runner, model = engine.runner, engine.runner.model
    captured = []
    execute = runner.execute_argmax  # what the engine's step calls

    def both(step, argmax=True, logits=True):
        stack = model.native_stack
        hidden = model(step.input_ids, step.positions, runner.kv_caches, step.metadata)
        model.native_stack = None
        try:  # the module path rewrites the same KV slots with the same values
            reference = model(step.input_ids, step.positions, runner.kv_caches, step.metadata)
        finally:
            model.native_stack = stack
        captured.append((step.metadata.num_decode_tokens, len(step.metadata.prefills), hidden, reference))
        return execute(step, argmax, logits)

    runner.execute_argmax = both
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert any(decodes and prefills for decodes, prefills, _, _ in captured), "no mixed step ran"
    for _, _, hidden, reference in captured:
        assert hidden.dtype == reference.dtype and torch.equal(hidden, reference)


@pytest.mark.skipif(not invariant.available(), reason="the batch-invariant quantized kernels need AVX-512 BF16")
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_native_stack_equals_modules_quantized(tiny_model_factory, quantization):
    path = tiny_model_factory(hidden_size=128, intermediate_size=256)
    kw = dict(quantization=quantization, quant_group_size=32, max_num_batched_tokens=32)
    native, engine = _run(path, "bfloat16", eager=False, **kw)
    assert engine.runner.model.native_stack is not None
    assert set(engine.runner.model.native_stack.lin_meta[::2]) == {2}  # every linear on tessera_qgemm.qgemm
    eager, _ = _run(path, "bfloat16", eager=True, **kw)
    assert native == eager


@pytest.mark.skipif(not on_int8_activations(), reason="gguf mode is not on int8 activations here (AMX, or no kernels)")
@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("qtype,kind", [("Q4_0", 5), ("Q4_1", 5), ("Q8_0", 6)])
def test_native_stack_equals_modules_gguf_int8_activations(tiny_model_factory, tmp_path, dtype, qtype, kind):
    """--quantization gguf on an x86 CPU without AMX: every layer's blocks on tessera_gemv.q4x8 /
    q8x8 through the stack (kinds 5, 6), for prefill chunks and decodes alike; a bf16 step's
    activations go to the kernels in float32 and come back in bf16, as through the modules."""
    from gguf import GGMLQuantizationType as Q

    model_dir = tiny_model_factory(hidden_size=128, intermediate_size=256)
    path = write_gguf_from_hf_dir(model_dir, tmp_path / f"tiny-{qtype}.gguf", qtype=Q[qtype])
    kw = dict(quantization="gguf", max_num_batched_tokens=32)
    native, engine = _run(path, dtype, eager=False, **kw)
    assert engine.runner.model.native_stack is not None
    assert set(engine.runner.model.native_stack.lin_meta[::2]) == {kind}
    eager, _ = _run(path, dtype, eager=True, **kw)
    assert native == eager


def test_quantized_kv_takes_the_module_path(tiny_model_factory):
    dtype = _dtypes()[0]
    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory()), dtype=dtype, deterministic=dtype == "float32",
                                    max_model_len=256, kv_cache_dtype="int8"))
    stack = engine.runner.model.native_stack
    assert stack is not None
    calls = []
    forward = stack.forward
    stack.forward = lambda *a: calls.append(forward(*a)) or calls[-1]
    engine.add_request("0", PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert calls and all(c is None for c in calls)  # refused every step: int8 codes are not bf16/fp32 K/V
    assert len(outputs[0].outputs[0].token_ids) == 3
