#!/usr/bin/env bash
# llama.cpp with CUDA on the GPU machine (llama-bench, and the shared libraries it loads: libllama.so included,
# so llama-cpp-python's Python files could load it through LLAMA_CPP_LIB_PATH=/tmp/llama/build/bin).
# Run from the repository root:
#   bench/gpu/build_llama.sh start       a carried build (.gpu/llama-bin.tar.xz.NN, made by `pack`) is unpacked
#                                        (seconds); otherwise the build starts in the background (setsid, log
#                                        /tmp/llama/build.log, ~5 min on 14 cores) and this returns at once
#   bench/gpu/build_llama.sh wait [SEC]  wait up to SEC s (default 420) for the build; rc 0 built, 1 failed,
#                                        2 still running
#   bench/gpu/build_llama.sh pack DIR    strip the built programs and write DIR/llama-bin.tar.xz.00 (and .01 if
#                                        needed: pieces of 15 MiB) to carry to the next call in .gpu/
# The programs end up in /tmp/llama/build/bin (the path their RPATH names); llama-bench: /tmp/llama/build/bin/llama-bench.
set -uo pipefail

ROOT=${LLAMA_ROOT:-/tmp/llama}   # other roots: for testing this script only (RPATHs name /tmp/llama)
SRC=$ROOT/src
BUILD=$ROOT/build
BIN=$BUILD/bin
LOG=$ROOT/build.log
RC=$ROOT/build.rc
JOBS=${LLAMA_JOBS:-14}
REPO=$(pwd)

ts() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*"; }
cpu_model() { grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'; }

built() { [ -x "$BIN/llama-bench" ] && [ -f "$RC" ] && [ "$(cat "$RC")" = 0 ]; }

do_build() {  # the background job
    set -e
    ts "build: cmake configure"
    if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
    # GGML_NATIVE: -march=native for this CPU (AVX-512, AMX). NCCL off: one GPU, and no runtime dependency on
    # the pip NCCL's location. Only llama-bench and what it links are built.
    cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DGGML_NATIVE=ON -DGGML_CUDA_NCCL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF ${LLAMA_CMAKE_EXTRA:-}
    ts "build: ninja -j $JOBS llama-bench"
    ninja -C "$BUILD" -j "$JOBS" llama-bench
    {
        echo "cpu: $(cpu_model)"
        echo "nvcc: $(nvcc --version | tail -1)"
        echo "built: $(date -u +%FT%TZ) with GGML_CUDA=ON CMAKE_CUDA_ARCHITECTURES=90 GGML_NATIVE=ON"
    } >"$BIN/BUILD-INFO.txt"
    ts "build: done"
}

cmd=${1:-}
case "$cmd" in
start)
    mkdir -p "$ROOT"
    if built; then
        ts "llama.cpp: already built in $BIN"
        exit 0
    fi
    if ls "$REPO"/.gpu/llama-bin.tar.xz.[0-9][0-9] >/dev/null 2>&1; then
        mkdir -p "$BIN"
        cat "$REPO"/.gpu/llama-bin.tar.xz.[0-9][0-9] | tar -xJ -C "$BIN" || { ts "llama.cpp: carried build unpack failed"; exit 1; }
        echo 0 >"$RC"
        ts "llama.cpp: carried build unpacked to $BIN"
        sed 's/^/  /' "$BIN/BUILD-INFO.txt"
        if ! grep -qF "cpu: $(cpu_model)" "$BIN/BUILD-INFO.txt"; then
            ts "WARNING: this CPU ($(cpu_model)) is not the one the carried build was made for (-march=native)"
        fi
        LD_LIBRARY_PATH=$BIN "$BIN/llama-bench" --list-devices 2>&1 | tail -3
        exit 0
    fi
    if [ -f "$ROOT/build.pid" ] && kill -0 "$(cat "$ROOT/build.pid")" 2>/dev/null; then
        ts "llama.cpp: build already running (pid $(cat "$ROOT/build.pid"))"
        exit 0
    fi
    rm -rf "$SRC" && mkdir -p "$SRC"
    tar -xzf "$REPO/.gpu/llama.cpp.tar.gz" -C "$SRC" --strip-components=1 || { ts "llama.cpp: no source tarball"; exit 1; }
    rm -f "$RC"
    # setsid: its own session, so it outlives this call's shell while the machine stays warm.
    setsid bash -c "bash '$REPO/bench/gpu/build_llama.sh' _build >'$LOG' 2>&1; echo \$? >'$RC'" </dev/null &
    echo $! >"$ROOT/build.pid"
    ts "llama.cpp: build started in the background (log $LOG)"
    ;;
_build)
    do_build
    ;;
wait)
    limit=${2:-420}
    t0=$(date +%s)
    last=0
    while [ ! -f "$RC" ]; do
        if ! { [ -f "$ROOT/build.pid" ] && kill -0 "$(cat "$ROOT/build.pid")" 2>/dev/null; } && [ ! -f "$RC" ]; then
            ts "llama.cpp: no build running and none finished (run: build_llama.sh start)"
            exit 1
        fi
        now=$(date +%s)
        if [ $((now - t0)) -ge "$limit" ]; then
            ts "llama.cpp: still building after ${limit} s: $(grep -o '^\[[0-9]*/[0-9]*\]' "$LOG" 2>/dev/null | tail -1)"
            exit 2
        fi
        if [ $((now - last)) -ge 30 ]; then
            ts "llama.cpp: building $(grep -o '^\[[0-9]*/[0-9]*\]' "$LOG" 2>/dev/null | tail -1)"
            last=$now
        fi
        sleep 2
    done
    if [ "$(cat "$RC")" != 0 ]; then
        ts "llama.cpp: build FAILED (rc $(cat "$RC")); end of $LOG:"
        tail -30 "$LOG"
        exit 1
    fi
    ts "llama.cpp: built: $BIN/llama-bench"
    ;;
pack)
    dest=${2:?usage: build_llama.sh pack DIR}
    built || { ts "llama.cpp: nothing built to pack"; exit 1; }
    mkdir -p "$dest" "$ROOT/pack"
    rm -rf "$ROOT/pack"/*
    cd "$BIN" || exit 1
    files=$(ls llama-bench BUILD-INFO.txt lib*.so* 2>/dev/null)
    tar -cf "$ROOT/pack/bin.tar" $files
    mkdir -p "$ROOT/pack/x" && tar -xf "$ROOT/pack/bin.tar" -C "$ROOT/pack/x"
    find "$ROOT/pack/x" -type f \( -name '*.so*' -o -name llama-bench \) -exec strip --strip-unneeded {} +
    (cd "$ROOT/pack/x" && tar -cf - $files) | xz -T0 -6 >"$ROOT/pack/llama-bin.tar.xz"
    rm -f "$dest"/llama-bin.tar.xz.*
    split -d -a 2 -b 15M "$ROOT/pack/llama-bin.tar.xz" "$dest/llama-bin.tar.xz."
    n=$(ls "$dest"/llama-bin.tar.xz.* | wc -l)
    ts "llama.cpp: packed $(du -sh "$ROOT/pack/bin.tar" | cut -f1) of programs into $n file(s): $(du -ch "$dest"/llama-bin.tar.xz.* | tail -1 | cut -f1)"
    ls -la "$dest"/llama-bin.tar.xz.*
    if [ "$n" -gt 2 ]; then ts "WARNING: more than 2 pieces"; exit 1; fi
    ;;
*)
    sed -n '2,15p' "$0"
    exit 64
    ;;
esac
