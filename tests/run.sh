#!/usr/bin/env bash
# Install strata-nb with everything its tests compare against, then run the test suite.
# Works on a fresh machine with PyPI access; re-running skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMA_CPP_PY=0.3.36
CACHE="${STRATA_NB_CACHE:-$HOME/.cache/strata-nb}"
SDIST_DIR="$CACHE/sdist"
export STRATA_VOCAB_DIR="${STRATA_VOCAB_DIR:-$CACHE/llama-vocab}"

# serve-ray: tests/test_serve_ray.py runs two Ray Serve replicas (it skips only where ray is missing)
python -m pip install -q -e ".[test,serve-ray]"
# The oracles: transformers on a CPU torch, and llama.cpp through llama-cpp-python built from its sdist.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -c "import transformers, accelerate" 2>/dev/null || python -m pip install -q "transformers>=4.46" accelerate

sdist="$SDIST_DIR/llama_cpp_python-$LLAMA_CPP_PY.tar.gz"
if [ ! -f "$sdist" ]; then
    mkdir -p "$SDIST_DIR"
    python -m pip download -q --no-deps --no-binary :all: -d "$SDIST_DIR" "llama-cpp-python==$LLAMA_CPP_PY"
fi
if ! python -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$LLAMA_CPP_PY')" 2>/dev/null; then
    echo "building llama-cpp-python $LLAMA_CPP_PY (a few minutes) ..."
    CMAKE_ARGS="-DGGML_NATIVE=ON" python -m pip install -q "$sdist"
fi
# llama.cpp's own tokenizer test vocabularies (real GGUF vocabularies with expected token ids) ship in the sdist.
# Its chat templates (models/templates/) are the real-world set the chat renderer is checked on.
if [ ! -f "$STRATA_VOCAB_DIR/ggml-vocab-qwen2.gguf" ] || [ ! -d "$STRATA_VOCAB_DIR/templates" ]; then
    mkdir -p "$STRATA_VOCAB_DIR"
    tar -xzf "$sdist" -C "$STRATA_VOCAB_DIR" --strip-components=4 --wildcards \
        "llama_cpp_python-$LLAMA_CPP_PY/vendor/llama.cpp/models/ggml-vocab-*" \
        "llama_cpp_python-$LLAMA_CPP_PY/vendor/llama.cpp/models/templates/*"
fi
# llama.cpp's HF -> GGUF converter with the gguf-py it needs (newer than the gguf package): tests/family.py converts
# tiny random qwen3next / qwen35moe models with it. VERSION marks a complete extraction (family.py checks it too).
# Older sdists have no conversion/ (one convert_hf_to_gguf.py), hence the check instead of tar's exit status.
CONVERT_DIR="$CACHE/llama-convert"
if [ "$(cat "$CONVERT_DIR/VERSION" 2>/dev/null)" != "$LLAMA_CPP_PY" ]; then
    rm -rf "$CONVERT_DIR"
    mkdir -p "$CONVERT_DIR"
    tar -xzf "$sdist" -C "$CONVERT_DIR" --strip-components=3 --wildcards \
        "llama_cpp_python-$LLAMA_CPP_PY/vendor/llama.cpp/convert_hf_to_gguf.py" \
        "llama_cpp_python-$LLAMA_CPP_PY/vendor/llama.cpp/gguf-py/*" \
        "llama_cpp_python-$LLAMA_CPP_PY/vendor/llama.cpp/conversion/*" 2>/dev/null || true
    if [ ! -f "$CONVERT_DIR/convert_hf_to_gguf.py" ] || [ ! -d "$CONVERT_DIR/gguf-py/gguf" ]; then
        echo "no llama.cpp converter in $sdist" >&2
        exit 1
    fi
    echo "$LLAMA_CPP_PY" > "$CONVERT_DIR/VERSION"
fi

python -m pytest -q "$@"
