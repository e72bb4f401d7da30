#!/usr/bin/env bash
# The benchmark models, written on the GPU machine's disk (after `. bench/gpu/setup.sh`, from the repo root):
#   bench/gpu/synth.sh start MODEL...   write MODELs in the background (setsid; in parallel), return at once
#   bench/gpu/synth.sh run MODEL...     write MODELs in parallel, in the foreground
#   bench/gpu/synth.sh wait [SEC] MODEL...   wait up to SEC s (default 300); rc 0 all written, 1 one failed, 2 late
#   bench/gpu/synth.sh path MODEL       print the model's path
# SYNTH_NICE (default 0): the writers' nice level (call 1 lowers them below the llama.cpp build).
# MODEL: uniform  $STRATA_MODELS/q30-Q4_K_M.gguf          synthetic qwen3moe, full Qwen3-30B-A3B shapes, Q4_K_M
#        skewed   $STRATA_MODELS/q30-Q4_K_M-skew1.2.gguf  the same with --router-skew 1.2 (calibrated by a pilot
#                                                         forward: compiles the CPU kernels on a cold numba cache)
#        smoke    $STRATA_MODELS/q30-L2-Q4_K_M.gguf       the first 2 layers only (1.2 GB): smoke tests
#        next     $STRATA_MODELS/qnext-Q4_K_M.gguf        synthetic qwen3next, full Qwen3-Next-80B-A3B shapes, Q4_K_M
#                                                         (48.5 GB: the disk holds it or uniform+skewed, not both)
# STRATA_MODELS defaults to /tmp/models. A file that exists is complete (synth writes NAME.partial, then
# renames), so it is not written again on a warm machine. Each model logs to $STRATA_MODELS/NAME.log.
set -uo pipefail
DIR=${STRATA_MODELS:-/tmp/models}
mkdir -p "$DIR"

ts() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

path_of() {
    case "$1" in
    uniform) echo "$DIR/q30-Q4_K_M.gguf" ;;
    skewed) echo "$DIR/q30-Q4_K_M-skew1.2.gguf" ;;
    smoke) echo "$DIR/q30-L2-Q4_K_M.gguf" ;;
    next) echo "$DIR/qnext-Q4_K_M.gguf" ;;
    *) echo "synth.sh: unknown model '$1' (uniform, skewed, smoke, next)" >&2; return 1 ;;
    esac
}

args_of() {
    case "$1" in
    uniform) echo "--preset qwen3-30b-a3b" ;;
    skewed) echo "--preset qwen3-30b-a3b --router-skew 1.2" ;;
    smoke) echo "--preset qwen3-30b-a3b --layers 2" ;;
    next) echo "--preset qwen3-next-80b-a3b" ;;
    esac
}

write_one() {  # MODEL: the foreground writer of one model, timed
    local m=$1 out t0 rc
    out=$(path_of "$m") || return 1
    if [ -f "$out" ]; then
        ts "synth $m: $out exists"
        echo 0 >"$DIR/$m.rc"
        return 0
    fi
    t0=$(date +%s%N)
    ts "synth $m: writing $out"
    # shellcheck disable=SC2046
    strata-nb synth --quant Q4_K_M --seed 0 $(args_of "$m") -o "$out"
    rc=$?
    t0=$((($(date +%s%N) - t0) / 100000000))
    ts "synth $m: rc $rc after $((t0 / 10)).$((t0 % 10)) s"
    echo $rc >"$DIR/$m.rc"
    return $rc
}

cmd=${1:-}
shift || true
case "$cmd" in
start)
    for m in "$@"; do
        path_of "$m" >/dev/null || exit 1
        rm -f "$DIR/$m.rc"
        setsid nice -n "${SYNTH_NICE:-0}" bash "$(pwd)/bench/gpu/synth.sh" _one "$m" >"$DIR/$m.log" 2>&1 </dev/null &
        ts "synth $m: started in the background (log $DIR/$m.log)"
    done
    ;;
_one)
    write_one "$1"
    ;;
path)
    path_of "${1:?usage: synth.sh path MODEL}"
    ;;
run)
    pids=()
    for m in "$@"; do
        path_of "$m" >/dev/null || exit 1
        ts "synth $m: writing (log $DIR/$m.log)"
        nice -n "${SYNTH_NICE:-0}" bash "$0" _one "$m" >"$DIR/$m.log" 2>&1 &
        pids+=($!)
    done
    rc=0
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    for m in "$@"; do
        tr '\r' '\n' <"$DIR/$m.log" | grep -v '^writing tensors' | tail -4
    done
    exit $rc
    ;;
wait)
    limit=${1:-300}
    shift || true
    t0=$(date +%s)
    for m in "$@"; do
        path_of "$m" >/dev/null || exit 1
        while [ ! -f "$DIR/$m.rc" ]; do
            if [ $(($(date +%s) - t0)) -ge "$limit" ]; then
                ts "synth $m: not done after ${limit} s: $(tail -c 200 "$DIR/$m.log" 2>/dev/null | tr '\r' '\n' | tail -1)"
                exit 2
            fi
            sleep 2
        done
        if [ "$(cat "$DIR/$m.rc")" != 0 ]; then
            ts "synth $m: FAILED:"
            tail -20 "$DIR/$m.log"
            exit 1
        fi
        ts "synth $m: $(grep -h 'rc 0 after\|exists' "$DIR/$m.log" | tail -1 | cut -d' ' -f4-)"
    done
    ;;
*)
    sed -n '2,12p' "$0"
    exit 64
    ;;
esac
