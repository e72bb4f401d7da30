#!/usr/bin/env bash
# Install strata-nb with everything its tests compare against, then run the test suite.
# Works on a fresh machine with PyPI access; re-running skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMA_CPP_PY=0.3.36
CACHE="${STRATA_NB_CACHE:-$HOME/.cache/strata-nb}"
SDIST_DIR="$CACHE/sdist"
export STRATA_VOCAB_DIR="${STRATA_VOCAB_DIR:-$CACHE/llama-vocab}"

python -m pip install -q -e ".[test]"
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

python -m pytest -q "$@"
