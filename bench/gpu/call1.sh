#!/usr/bin/env bash
# Device call 1 (carry [".gpu"]; timeout_s 600): bash bench/gpu/call1.sh
# In parallel: the llama.cpp CUDA build (background) and the benchmark models (background: smoke, uniform,
# skewed: their timings are in $OUT/synth.log); meanwhile pytest on the real GPU (the cuda and hybrid tests,
# then the rest of the suite until its time is up); then the build is packed to $OUT, a smoke run of
# bench/hybrid_vs_llama.py on the 2-layer model checks both engines' paths, and the numba cache is packed.
# Everything is bounded to end by CALL_BUDGET seconds (default 560) after setup starts.
# $OUT afterwards: llama-bin.tar.xz.00 (.01), numba-cache.tar.xz, pytest.log, synth.log, smoke.md, smoke.json.
set -uo pipefail
BUDGET=${CALL_BUDGET:-560}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
. bench/gpu/setup.sh || exit 1
left() { echo $((BUDGET - ($(date +%s) - GPU_T0))); }
export LLAMA_BENCH=${LLAMA_ROOT:-/tmp/llama}/build/bin/llama-bench
SMOKE=$(bash bench/gpu/synth.sh path smoke)

bash bench/gpu/build_llama.sh start
SYNTH_NICE=10 bash bench/gpu/synth.sh start smoke uniform skewed   # the build keeps its 14 cores

ts "pytest: cuda and hybrid tests on the GPU"
t=$(($(left) - 330))
timeout -s INT -k 30 $((t > 60 ? t : 60)) python3 -m pytest -v -p no:cacheprovider -rfEs --durations=15 \
    tests/test_cuda_*.py tests/test_hybrid.py >"$OUT/pytest.log" 2>&1
ts "pytest (GPU tests): rc $?"
grep -E "FAILED|ERROR" "$OUT/pytest.log" | head -30
tail -25 "$OUT/pytest.log"

t=$(($(left) - 200))
if [ "$t" -gt 30 ]; then
    ts "pytest: the rest of the suite, for up to $t s"
    echo "===== the rest of the suite =====" >>"$OUT/pytest.log"
    timeout -s INT -k 20 "$t" nice -n 10 python3 -m pytest -v -p no:cacheprovider -rfE --durations=10 tests \
        --ignore-glob='tests/test_cuda_*.py' --ignore=tests/test_hybrid.py >>"$OUT/pytest.log" 2>&1
    ts "pytest (rest): rc $? (124/137: stopped at its time limit; pytest.log has one line per test run)"
    sed -n '/===== the rest of the suite =====/,$p' "$OUT/pytest.log" | grep -E "FAILED|ERROR" | head -30
    tail -15 "$OUT/pytest.log"
fi

t=$(($(left) - 110))
bash bench/gpu/build_llama.sh wait $((t > 5 ? t : 5)) && bash bench/gpu/build_llama.sh pack "$OUT"
bash bench/gpu/synth.sh wait 5 smoke uniform skewed
cat "${STRATA_MODELS:-/tmp/models}"/*.log 2>/dev/null | tr '\r' '\n' | grep -v '^writing tensors' >"$OUT/synth.log"
grep -h 'rc .* after\|exists\|FAILED\|Error' "$OUT/synth.log"

t=$(($(left) - 25))
if [ -x "$LLAMA_BENCH" ] && [ -f "$SMOKE" ] && [ "$t" -gt 45 ]; then
    ts "smoke: bench/hybrid_vs_llama.py on the 2-layer model, deadline $t s"
    python3 bench/hybrid_vs_llama.py -m "$SMOKE" --shares 1,0.5,0 --reps 1 \
        --gpubw-gib 2 --membw-gib 4 --deadline-s "$t" --first-arm-s 20 --out "$OUT/smoke" 2>&1 | tail -30
fi
bash bench/gpu/pack_cache.sh "$OUT"
ts "call 1 done; $OUT:"
ls -la "$OUT"
