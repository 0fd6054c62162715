"""GGUF K-quant and Q5 blocks, the lm_head and embedding in gguf mode, and the C++ decode GEMV.

References: the `gguf` package's own dequantization (bit for bit), F.linear on the dequantized
weight, the model loaded with the file's weights dequantized to float (the loader's path), and
the torch kernels for the C++ ones.
"""

from __future__ import annotations

import logging
import shutil

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

from tessera import native
from tessera.model.llama import LlamaForCausalLM
from tessera.model.weights import load_model_files
from tessera.quant import QuantLinear, invariant, native_gemv, quantize_model
from tessera.quant.gguf_embedding import QuantEmbedding, dequantize_rows
from tessera.quant.gguf_int8_activations import Q8BlocksLinear
from tessera.quant.gguf_kquant import KQUANT_TYPES, GGUFBlockLinear, decode_rows
from tessera.quant.gguf_native import ConcatLinear, Q8_0Linear, decode_q8_0, on_int8_activations
from tessera.quant.int4 import Int4Linear
from tessera.quant.int8 import Int8Linear
from tests.tiny_model import write_gguf_from_hf_dir
from tests.unit.test_quant_model import decode_logits, logits

# Byte offsets of the float16 fields (d, dmin, m) in each block: random bytes there could be NaN.
_F16_FIELDS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.Q8_0: [0]}


def random_blocks(qtype: Q, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random block bytes [rows, bytes per row] with finite float16 scales: every code, sign and
    6-bit scale pattern occurs, which llama.cpp-quantized weights would not all reach."""
    rng = np.random.default_rng(seed)
    block, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, k // block, nbytes), dtype=np.uint8)
    for at in _F16_FIELDS[qtype]:
        scale = (rng.standard_normal((rows, k // block, 1)) * 0.02).astype(np.float16)
        raw[..., at : at + 2] = scale.view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", KQUANT_TYPES)
def test_decode_rows_equals_gguf_bit_for_bit(qtype):
    raw = random_blocks(qtype, 5, 512)
    want = gguf.quants.dequantize(raw, qtype)
    got = decode_rows(torch.from_numpy(raw), qtype).numpy()
    assert got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1])
def test_decode_of_llama_cpp_quantized_q5_equals_gguf(qtype):
    w = np.random.default_rng(1).standard_normal((6, 256)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    want = gguf.quants.dequantize(raw, qtype)
    assert np.array_equal(decode_rows(torch.from_numpy(raw), qtype).numpy(), want)


@pytest.mark.parametrize("qtype", KQUANT_TYPES)
@pytest.mark.parametrize("m", [1, 5, 130])
def test_block_linear_matches_f_linear(qtype, m):
    raw = random_blocks(qtype, 600, 512, seed=2)  # 600 rows: several row tiles
    layer = GGUFBlockLinear(torch.from_numpy(raw.copy()), qtype)
    w = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(3))
    want = F.linear(x.double(), w.double())
    if layer.invariant:  # the AMX kernel computes with W rounded to bf16 (2^-9 relative per weight)
        err = (layer(x).double() - want).abs()
        assert (err <= 2**-8 * (x.double().abs() @ w.double().abs().t())).all()
    else:
        torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    assert layer.weight_bytes() == expected_bytes(qtype, 600, 512, layer.invariant, layer.f32_blocks is not None)


def expected_bytes(qtype: Q, rows: int, k: int, tiled: bool, panels: bool = False) -> int:
    """No float copy: the file's bytes; in tile order (gguf_tiles.py) rows padded to 32, and Q4_K /
    Q5_K keep their twelve bytes of 6-bit scales and mins per super-block in sixteen; in panel
    order (the AVX2 tiles) rows padded to 64, Q5_0 as int8 codes, Q4_K and Q6_K with float32 scales."""
    if panels:
        from tessera.quant.gguf_f32_blocks import BLOCK_BYTES

        return -(-rows // 64) * 64 * k // 32 * BLOCK_BYTES[qtype]
    row_bytes = k // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1]
    if not tiled:
        return rows * row_bytes
    return -(-rows // 32) * 32 * (row_bytes + (k // 256 * 4 if qtype in (Q.Q4_K, Q.Q5_K) else 0))


@pytest.mark.skipif(not invariant.available(), reason="the tile layout is the invariant kernel's (AVX-512 BF16)")
@pytest.mark.parametrize("qtype", KQUANT_TYPES)
def test_tile_layout_holds_the_files_weight_bit_for_bit(qtype):
    raw = random_blocks(qtype, 70, 512, seed=6)
    layer = GGUFBlockLinear(torch.from_numpy(raw.copy()), qtype)
    assert layer.invariant and not hasattr(layer, "raw")
    want = gguf.quants.dequantize(raw, qtype)
    assert np.array_equal(layer.dequantize().numpy().view(np.uint32), want.view(np.uint32))
    ids = torch.tensor([69, 0, 33, 16, 33])
    assert np.array_equal(layer.dequantize_rows(ids).numpy().view(np.uint32), want[ids.numpy()].view(np.uint32))


@pytest.mark.skipif(not invariant.available(), reason="the tile layout is the invariant kernel's (AVX-512 BF16)")
@pytest.mark.parametrize("qtype", KQUANT_TYPES)
def test_decode_rows_are_the_whole_k_paths_rows(qtype):
    """bf16 calls of 1-8 rows (without AMX: each tile row made in registers and multiplied at once,
    four column blocks at a time up to 4 rows, two above) give the same bits as the same rows in a
    9-row call (every tile made whole in memory first), for every bit-plane count, the sub-block
    scales and Q6_K's two scaled halves; 96 columns make a task of four column blocks and one of two."""
    layer = GGUFBlockLinear(torch.from_numpy(random_blocks(qtype, 96, 512, seed=7)), qtype)
    assert layer.invariant
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(8)).bfloat16()
    whole = layer(x)
    for m in range(1, 9):
        for start in (0, 9 - m):
            assert torch.equal(layer(x[start:start + m].contiguous()), whole[start:start + m]), (m, start)


def test_concat_linear_of_mixed_types():
    """A fused qkv whose parts have different block types (as in Q4_K_M files)."""
    raw8 = random_blocks(Q.Q8_0, 32, 256, seed=4)
    q8 = Q8_0Linear(*decode_q8_0(raw8, 32))
    raw6 = random_blocks(Q.Q6_K, 16, 256, seed=5)
    layer = ConcatLinear([q8, GGUFBlockLinear(torch.from_numpy(raw6.copy()), Q.Q6_K)])
    w = torch.cat([torch.from_numpy(gguf.quants.dequantize(r, t)) for r, t in ((raw8, Q.Q8_0), (raw6, Q.Q6_K))])
    x = torch.randn(3, 256)
    want = F.linear(x.double(), w.double())
    # float32 precision of a dot product: at most 2^-14 of sum |x w| (the AMX kernel carries x and
    # W to about 16 bits each as bf16 pairs; the torch kernels are float32 throughout).
    err = (layer(x).double() - want).abs()
    assert (err <= 2**-14 * (x.double().abs() @ w.double().abs().t()) + 1e-9).all()


def _int4_layer(rows: int, k: int = 128) -> Int4Linear:
    return Int4Linear.from_float(torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)), 32)


@pytest.mark.parametrize("make", [
    lambda: Q8_0Linear(*decode_q8_0(random_blocks(Q.Q8_0, 40, 128), 40)),
    lambda: _int4_layer(80),  # a 64-row block and a 16-row tail in pairs
    lambda: _int4_layer(128),
    lambda: GGUFBlockLinear(torch.from_numpy(random_blocks(Q.Q4_K, 40, 256)), Q.Q4_K),
], ids=["q8_0", "int4-tail", "int4", "q4_k"])
def test_dequantize_rows_equals_dequantize(make):
    layer = make()
    ids = torch.tensor([[0, 39, 7], [12, 12, 1]])
    want = layer.dequantize()[ids]
    assert torch.equal(dequantize_rows(layer, ids), want)
    assert torch.equal(QuantEmbedding(layer, torch.bfloat16)(ids), want.to(torch.bfloat16))


# ---- gguf mode on tiny models ---------------------------------------------------------------


def load(path, method="none") -> LlamaForCausalLM:
    files = load_model_files(path)
    model = LlamaForCausalLM(files.config, torch.float32)
    model.load_weights(files.weights())
    return quantize_model(model, method, model_files=files)


def prefill_and_decode_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits of every prompt position (prefill) and of the decode path, stacked."""
    return torch.cat([logits(model, ids), decode_logits(model, ids)])


PROMPT = [5, 70, 33, 101, 9, 250, 17, 88, 42, 3, 199, 64]


@pytest.mark.parametrize("qtype,tied", [(Q.Q5_0, True), (Q.Q5_1, False), (Q.Q8_0, True), (Q.Q4_1, True)])
def test_gguf_mode_lm_head_and_embedding_from_blocks(tiny_model_factory, tmp_path, qtype, tied, caplog):
    path = write_gguf_from_hf_dir(tiny_model_factory(tie_word_embeddings=tied), tmp_path / "t.gguf", qtype=qtype)
    ref = load(path)
    with caplog.at_level(logging.INFO, logger="tessera"):
        model = load(path, "gguf")
    assert f"{qtype.name} tensor(s) computed from their blocks" in caplog.text
    assert isinstance(model.lm_head, QuantLinear) and isinstance(model.embed_tokens, QuantEmbedding)
    assert not any(p.shape[0] == model.config.vocab_size for p in model.parameters())  # no float table
    if tied:
        assert model.embed_tokens.layer is model.lm_head
    got, want = prefill_and_decode_logits(model, PROMPT), prefill_and_decode_logits(ref, PROMPT)
    int8_activations = on_int8_activations() and qtype in (Q.Q4_1, Q.Q8_0, Q.Q5_0)
    if qtype == Q.Q4_1 or int8_activations:  # bf16 scales on the int4 kernel, or x rounded to int8
        assert F.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.999
    else:  # the file's exact weights
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_gguf_mode_model_goes_through_the_invariant_kernel_pass(tiny_model_factory, tmp_path):
    """The engine runs make_linears_invariant on every bf16 model on AMX, gguf mode included: it
    must read the slots of a model whose embedding is a QuantEmbedding, and leave the quantized
    weights (modules, not tensors) as they are."""
    from tessera.kernels.linear import make_linears_invariant

    path = write_gguf_from_hf_dir(tiny_model_factory(tie_word_embeddings=True), tmp_path / "t.gguf", qtype=Q.Q8_0)
    model = load(path, "gguf")
    want = prefill_and_decode_logits(model, PROMPT)
    assert make_linears_invariant(model) == 0
    assert isinstance(model.embed_tokens, QuantEmbedding) and isinstance(model.lm_head, QuantLinear)
    torch.testing.assert_close(prefill_and_decode_logits(model, PROMPT), want, rtol=0, atol=0)


def _gguf_log(caplog) -> dict[str, tuple[int, str, float]]:
    """The per-type lines of gguf_linears' log: type -> (tensors, what happened, MiB)."""
    lines = [r for r in caplog.records if r.msg.startswith("gguf: %d %s tensor(s)")]
    return {r.args[1]: (r.args[0], r.args[2], r.args[3]) for r in lines}


def test_float_tensors_are_logged_as_dequantized(tiny_model_dir, tmp_path, caplog):
    path = write_gguf_from_hf_dir(tiny_model_dir, tmp_path / "f32.gguf")
    with caplog.at_level(logging.INFO, logger="tessera"):
        model = load(path, "gguf")
    assert "F32 tensor(s) dequantized to torch.float32 (no native kernel)" in caplog.text
    assert isinstance(model.embed_tokens, torch.nn.Parameter)
    # Every 2-D weight of the file, each once, at 4 bytes a weight.
    weights = [p for n, p in model.named_parameters() if p.dim() == 2]
    count, _, mib = _gguf_log(caplog)["F32"]
    assert count == 7 * model.config.num_layers + 2  # q k v o gate up down a layer, embedding, lm_head
    assert mib == pytest.approx(sum(p.numel() * 4 for p in weights) / 2**20, rel=1e-9)


def test_native_tensors_are_logged_with_the_memory_they_take(tiny_model_dir, tmp_path, caplog):
    path = write_gguf_from_hf_dir(tiny_model_dir, tmp_path / "q5.gguf", qtype=Q.Q5_0)
    with caplog.at_level(logging.INFO, logger="tessera"):
        model = load(path, "gguf")
    layers = {id(m): m for m in model.modules() if isinstance(m, QuantLinear)}
    count, what, mib = _gguf_log(caplog)["Q5_0"]
    assert what == "computed from their blocks"
    assert count == 7 * model.config.num_layers + 2
    assert mib == pytest.approx(sum(m.weight_bytes() for m in layers.values()) / 2**20, rel=1e-9)
    # ...which is the file's Q5_0 bytes (rows padded to 32 in the AMX tile order): 5.5 bits a weight;
    # on int8 activations (x86 without AMX) int8 codes and float16 d in groups of 8 rows, and on the
    # AVX2 tiles int8 codes in panel order (rows padded to 64): 8.5 bits.
    files = load_model_files(path)
    file_bytes = sum(t.n_bytes for t in files.reader.tensors if t.tensor_type == Q.Q5_0)
    codes = any(isinstance(m, Q8BlocksLinear) or getattr(m, "f32_blocks", None) is not None for m in layers.values())
    assert file_bytes * (34 / 22 if codes else 1) <= mib * 2**20 <= file_bytes * (34 / 22 * 2 if codes else 1.3)


# ---- the C++ decode GEMV --------------------------------------------------------------------

needs_native = pytest.mark.skipif(not (native_gemv.cpu_supported() or native_gemv.avx2_only()),
                                  reason="the C++ GEMV needs AVX-512, or AVX2 + FMA (gemv_avx2.cpp)")


@needs_native
def test_native_gemv_builds_where_a_compiler_is():
    """CI has g++: a broken build must fail here, not silently fall back."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    assert native_gemv.available()


def _layers(n: int, k: int) -> dict[str, QuantLinear]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05
    return {
        "int8": Int8Linear.from_float(w),
        "int4": Int4Linear.from_float(w, 32),
        "q8_0": Q8_0Linear(*decode_q8_0(random_blocks(Q.Q8_0, n, k, seed=n), n)),
    }


@needs_native
@pytest.mark.parametrize("n,k", [(960, 576), (80, 64), (48, 96)])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_native_kernels_match_the_dequantized_weight(n, k, m, monkeypatch):
    monkeypatch.setenv("TESSERA_QUANT_INVARIANT", "0")  # the GEMV serves AVX-512 CPUs without AMX
    if not native_gemv.available():
        pytest.skip("native GEMV not built")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    for name, layer in _layers(n, k).items():
        want = F.linear(x.double(), layer.dequantize().double()).float()
        torch.testing.assert_close(layer(x, kernel="native"), want, rtol=1e-4, atol=1e-4, msg=name)
        if name != "int4" or native_gemv.avx2_only():  # AVX-512's int4 GEMV is slower than int4pack
            assert layer.select_kernel(m) == "native"
    bf = _layers(n, k)["int8"](x.bfloat16(), kernel="native")
    assert bf.dtype == torch.bfloat16


def test_without_the_extension_the_torch_kernels_run(monkeypatch):
    monkeypatch.setenv("TESSERA_QUANT_INVARIANT", "0")
    monkeypatch.setattr(native_gemv, "available", lambda: False)
    x = torch.randn(1, 64)
    for name, layer in _layers(80, 64).items():
        assert layer.select_kernel(1) != "native", name
        with torch.inference_mode():  # as the model runs them (the kernels' scratch buffers)
            torch.testing.assert_close(layer(x), F.linear(x, layer.dequantize()), rtol=1e-2, atol=1e-2)


def test_a_failed_build_falls_back_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++\n")
    with caplog.at_level(logging.WARNING, logger="tessera"):
        assert native.load_extension("tessera_test_broken", (bad,)) is False
    assert "could not be built" in caplog.text and "TESSERA_NATIVE=0" in caplog.text


def test_native_off_by_environment(monkeypatch):
    monkeypatch.setenv("TESSERA_NATIVE", "0")
    assert native.load_extension.__wrapped__("tessera_gemv", ()) is False
