#!/usr/bin/env bash
# Device call during development (carry [".gpu"]): the GPU test files, the matrix kernels' launch shapes
# (VARIANTS="4x4,4x2,..." runs matvec_variants.py), per-kernel decode times on the 2-layer model, then PROBES="0.5
# 0.5:GOMP_SPINCOUNT=30000000 1" runs pool_probe.py on the full model (BENCH_MODEL: uniform, or next for Qwen3-Next
# shapes) once per entry (VRAM share, then the environment of that run), then hybrid_vs_llama.py on it with whatever
# time is left (BENCH_ARGS=none: no benchmark; BENCH_IF_PASSED=1: none unless the tests passed); TRACE="1 0 1:ENV=V"
# runs trace_decode.py at those shares (then that run's environment) before the probes (TRACE_ARGS passed on, e.g.
# --warmup-seed 1). PACK=1 packs the numba cache into $OUT for the next call's .gpu/. LAUNCH_PROBE=1 runs
# launch_probe.py; LLAMA_PACK=1 packs the llama.cpp build into $OUT (after the traces). KERNEL_PROBE=1 runs
# kernel_probe.py (decode attention variants, small kernels, experts; KERNEL_PROBE_ARGS e.g. --no-attention) after
# the tests.
set -uo pipefail
BUDGET=${CALL_BUDGET:-560}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
. bench/gpu/setup.sh || exit 1
left() { echo $((BUDGET - ($(date +%s) - GPU_T0))); }
export LLAMA_BENCH=${LLAMA_ROOT:-/tmp/llama}/build/bin/llama-bench
export BENCH_MIRROR_DIR=$OUT
SMOKE=$(bash bench/gpu/synth.sh path smoke)
MODEL=${BENCH_MODEL:-uniform}  # the file of the trace, probes and benchmark (synth.sh's names: uniform, next)
UNI=$(bash bench/gpu/synth.sh path "$MODEL")
bash bench/gpu/build_llama.sh start
if [ "${BENCH_ARGS:-}" = none ] && [ -z "${PROBES:-}${TRACE:-}" ]; then SYNTH_NICE=10 bash bench/gpu/synth.sh start smoke
elif [ "${PROFILE_S:-100}" = 0 ]; then SYNTH_NICE=10 bash bench/gpu/synth.sh start "$MODEL"
else SYNTH_NICE=10 bash bench/gpu/synth.sh start smoke "$MODEL"; fi
pack() { [ "${PACK:-0}" = 1 ] && bash bench/gpu/pack_cache.sh "$OUT"; }
ts "pytest GPU files"
timeout -s INT -k 20 ${PYTEST_S:-200} python3 -m pytest -q -p no:cacheprovider -rfE ${TESTS:-tests/test_cuda_ops.py tests/test_cuda_matmul.py tests/test_hybrid.py} >"$OUT/pytest.log" 2>&1
rc=$?; ts "pytest rc $rc"; grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest.log" | tail -15
if [ "${BENCH_IF_PASSED:-0}" = 1 ] && [ "$rc" != 0 ]; then echo "tests failed: no probes, no benchmark"; pack; exit 1; fi
if [ "${KERNEL_PROBE:-0}" = 1 ]; then
    ts "kernel_probe"
    timeout -k 10 ${KERNEL_PROBE_S:-120} python3 bench/gpu/kernel_probe.py ${KERNEL_PROBE_ARGS:-} 2>&1 | grep -v -i warn | tee "$OUT/kernel_probe.log"
fi
if [ -n "${VARIANTS:-}" ]; then
    ts "matvec_variants $VARIANTS"
    timeout -k 10 ${VARIANTS_S:-150} python3 bench/gpu/matvec_variants.py --variants "$VARIANTS" --copies ${VARIANTS_COPIES:-1} 2>&1 | grep -v -i warn | tee "$OUT/variants.log"
fi
if [ "${PROFILE_S:-100}" != 0 ]; then
    bash bench/gpu/synth.sh wait 60 smoke
    ts "profile_decode"
    timeout -k 10 ${PROFILE_S:-100} python3 bench/gpu/profile_decode.py -m "$SMOKE" 2>&1 | grep -v -i warn | tee "$OUT/profile.log"
fi
if [ -n "${PROBES:-}${TRACE:-}" ] || [ "${BENCH_ARGS:-}" != none ]; then
    bash bench/gpu/synth.sh wait ${SYNTH_WAIT_S:-180} "$MODEL"
    grep -h 'rc .* after' /tmp/models/*.log | tr '\r' '\n' | tail -3
fi
for p in ${TRACE:-}; do  # TRACE="1 0 1:STRATA_NB_ATT_HEADS=2": trace_decode.py at those VRAM shares (then that run's
    # environment, as PROBES; TRACE_ARGS: e.g. --warmup-seed 1)
    sh=${p%%:*}; envs=""; [ "$p" != "$sh" ] && envs=$(echo "${p#*:}" | tr ':' ' ')
    bash bench/gpu/synth.sh wait ${SYNTH_WAIT_S:-180} "$MODEL"
    ts "trace_decode share $sh $envs ${TRACE_ARGS:-}"
    timeout -k 10 ${TRACE_S:-150} env $envs python3 bench/gpu/trace_decode.py -m "$UNI" --share "$sh" ${TRACE_ARGS:-} 2>&1 | grep -v -i warn | tee -a "$OUT/trace.log"
done
if [ "${LAUNCH_PROBE:-0}" = 1 ]; then  # graph launch host cost and gate latency (launch_probe.py)
    ts "launch_probe"
    timeout -k 10 ${LAUNCH_PROBE_S:-90} python3 bench/gpu/launch_probe.py 2>&1 | grep -v -i warn | tee "$OUT/launch_probe.log"
fi
if [ "${LLAMA_PACK:-0}" = 1 ]; then  # the llama.cpp build, for the next call's .gpu/
    bash bench/gpu/build_llama.sh wait ${LLAMA_WAIT_S:-120} && bash bench/gpu/build_llama.sh pack "$OUT"
fi
for p in ${PROBES:-}; do
    share=${p%%:*}; envs=""; [ "$p" != "$share" ] && envs=$(echo "${p#*:}" | tr ':' ' ')
    ts "pool_probe share $share $envs"
    timeout -k 10 ${PROBE_S:-120} env $envs python3 bench/gpu/pool_probe.py -m "$UNI" --share "$share" 2>&1 | grep -v -i warn | tee -a "$OUT/probe.log"
done
[ "${BENCH_ARGS:-}" = none ] && { pack; ls -la "$OUT"; exit 0; }
t=$(($(left) - 15))
ts "hybrid_vs_llama.py, deadline $t s"
python3 bench/hybrid_vs_llama.py -m "$UNI" --deadline-s "$t" ${BENCH_ARGS:---shares 1,0.5,0 --reps 1} 2>&1 | grep -v -i warn | tail -40
pack
ls -la "$OUT"
