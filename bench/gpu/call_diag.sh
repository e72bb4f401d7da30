#!/usr/bin/env bash
# Device call (carry [".gpu"]): diagnostics of the hybrid engine on the real GPU, the GPU test files, the llama.cpp
# build in the background (packed to $OUT), per-kernel decode times on the 2-layer model.
set -uo pipefail
BUDGET=${CALL_BUDGET:-560}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
. bench/gpu/setup.sh || exit 1
left() { echo $((BUDGET - ($(date +%s) - GPU_T0))); }
SMOKE=$(bash bench/gpu/synth.sh path smoke)
bash bench/gpu/build_llama.sh start
SYNTH_NICE=10 bash bench/gpu/synth.sh start smoke

ts "diagnose"
timeout -k 10 200 python3 bench/gpu/diagnose.py 2>&1 | tee "$OUT/diagnose.log" | grep -v Warning
bash bench/gpu/synth.sh wait 60 smoke
ts "profile_decode"
timeout -k 10 90 python3 bench/gpu/profile_decode.py -m "$SMOKE" 2>&1 | tee "$OUT/profile.log"
t=$(($(left) - 120))
ts "pytest GPU files for up to $t s"
timeout -s INT -k 20 $((t > 30 ? t : 30)) python3 -m pytest -q -p no:cacheprovider -rfE tests/test_cuda_*.py tests/test_hybrid.py >"$OUT/pytest.log" 2>&1
ts "pytest rc $?"; tail -15 "$OUT/pytest.log"
t=$(($(left) - 60))
bash bench/gpu/build_llama.sh wait $((t > 5 ? t : 5)) && bash bench/gpu/build_llama.sh pack "$OUT"
bash bench/gpu/pack_cache.sh "$OUT"
grep -h 'rc .* after' /tmp/models/*.log | tr '\r' '\n' | tail -3
ls -la "$OUT"
