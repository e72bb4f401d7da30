#!/usr/bin/env bash
# Device call 2 (and 3) (carry [".gpu"], with call 1's llama-bin.tar.xz.* and numba-cache.tar.xz copied into
# .gpu/; timeout_s 600):
#   bash bench/gpu/bench_call.sh both [hybrid_vs_llama.py options]     both files in one call (see below)
#   bash bench/gpu/bench_call.sh uniform [options]                      one file, all arms
#   bash bench/gpu/bench_call.sh skewed --profile-run [options]         one file, all arms
# Sets up, unpacks the carried llama.cpp build (builds it if none was carried: ~5 min of the budget), writes the
# model(s) in parallel (skipped when a warm machine still has them), runs bench/hybrid_vs_llama.py with a
# deadline that ends it by CALL_BUDGET s (default 560) after setup starts, and copies the results (.md, .json)
# to $OUT. `both`: the uniform file with every arm until SPLIT (default 0.6) of the time left, then the skewed
# file with --profile-run --no-llama (llama.cpp's static placements read the same bytes whatever the routing).
set -uo pipefail
BUDGET=${CALL_BUDGET:-560}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
what=${1:?usage: bench_call.sh both|uniform|skewed [hybrid_vs_llama.py options]}
shift
case "$what" in
both) models="uniform skewed" ;;
*) models=$what ;;
esac
for m in $models; do bash bench/gpu/synth.sh path "$m" >/dev/null || exit 1; done
. bench/gpu/setup.sh || exit 1
left() { echo $((BUDGET - ($(date +%s) - GPU_T0))); }
export LLAMA_BENCH=${LLAMA_ROOT:-/tmp/llama}/build/bin/llama-bench
export BENCH_MIRROR_DIR=$OUT   # hybrid_vs_llama.py copies its results there after every run

bash bench/gpu/build_llama.sh start
# shellcheck disable=SC2086
bash bench/gpu/synth.sh run $models || exit 1
bash bench/gpu/build_llama.sh wait $(($(left) - 120)) || exit 1

bench() {  # MODEL DEADLINE_S [options]
    local f
    f=$(bash bench/gpu/synth.sh path "$1")
    ts "benchmark: $f, deadline $2 s"
    python3 bench/hybrid_vs_llama.py -m "$f" --deadline-s "$2" "${@:3}"
    ts "benchmark: rc $?"
}

if [ "$what" = both ]; then
    bench uniform "$(python3 -c "print(int(($(left) - 10) * ${SPLIT:-0.6}))")" "$@"
    bench skewed $(($(left) - 10)) --profile-run --no-llama --no-bandwidth "$@"
else
    bench "$what" $(($(left) - 10)) "$@"
fi
ls -la "$OUT"
