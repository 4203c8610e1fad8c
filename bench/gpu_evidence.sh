#!/usr/bin/env bash
# GPU evidence in one command: environment, tests/gpu, tests/gpu under PyTorch's CUDA stream
# sanitizer, the stage replays of PP=4 VPP=2 (hidden 4096, bf16; stage 0, and the last stage on
# deterministic kernels so that its losses and grads rows are a bit-for-bit check) beside
# megatron-core's built-in offload (--compare megatron, --budget-bytes megatron), the co-planned
# stage of README (offload and selective recompute), the PP=1 comparisons with megatron's built-in
# (bench/megatron_compare.py), the pinned-memcpy bandwidth probe and the host-overhead bench. At
# most 8 files under the output folder: evidence.log (every step's output, in order),
# summary.txt (one line per step: status, seconds, limit), replay.json, replay_last.json,
# replay_coplan.json, compare.json (hidden 4096), compare_host.json (host-bound), bandwidth.json.
#
# Each step runs under its own time limit, all within one budget (--budget, default 540 s, so that
# a 15-minute device session holds the machine's start, the run and a rerun of one step): a step's
# limit is cut to what is left, a step with under 15 s left is skipped (listed in summary.txt). A
# failing step does not stop the others; the exit status is 1 if any failed, timed out or skipped.
# The steps whose times are no measure run first, side by side (BESIDE): what they check
# (bit-identity, stream order, each process's own device peak and R) does not need the device
# alone. The steps that time something then run one at a time, alone on the device.
# On an H200 (bench/results/2026-11-28-h200) the side-by-side steps took 102 s together (320 s one
# after another), overhead 31 s, replay 110 s, compare 151 s with 7 runs; the host-bound compare
# did not end in 200 s: under --profile 2 each of its runs' processes took 27-48 s for 9-17 s of
# training. Its profiles are now opt-in (COMPARE_HOST_PROFILE, below); the profiles of the
# engine's host path come from the overhead step and the replay's host time row. Each comparison
# run trains in a process of its own; its JSON row, written as the run ends, has its wall time
# (wall_s) and its process's (process_s). What ended comes back if a limit cuts the rest (rerun it
# with --only). summary.txt ends with the side-by-side steps' wall and the total. Without a CUDA
# device (or --dry-run) it prints the steps it would run and exits 0.
#
# On a lent GPU machine (no network; see shared/GPU.md), carry the wheels in .whl/ (ignored by
# git): every .whl/*.whl is installed to /tmp/site first. Prepare them on a host with network:
#   bash bench/gpu_evidence.sh --fetch-wheels      # megatron-core 0.19.2 (cp312)
# then, on the GPU machine:
#   bash bench/gpu_evidence.sh --out "$OUT"
# and commit what comes back under bench/results/<date>-<device>/ with the exact command.
#
# Environment: PYTHON (default python3), OUT (output folder without --out), REPLAY_SEQS (sequence
# lengths tried in turn when one does not fit; default "4096 2048 1024"), REPLAY_MODULES (core_attn,qkv_linear),
# COMPARE_HOST_PROFILE (steps each host-bound comparison run profiles, --profile; default 0).
set -u -o pipefail

readonly STEPS=(install env tests sanitizer sanitizer_pp4 replay_last replay_coplan overhead replay compare compare_host bandwidth)
readonly BESIDE=" tests sanitizer sanitizer_pp4 replay_last replay_coplan "  # run side by side, first (see above)
declare -A LIMIT=([install]=20 [env]=15 [tests]=90 [compare]=300 [compare_host]=200 [sanitizer]=150 [replay]=150 [overhead]=60 [replay_last]=150 [replay_coplan]=90 [bandwidth]=30 [sanitizer_pp4]=150)
declare -A CMD=(
    [install]='install_wheels'
    [env]='print_environment'
    [tests]='"$PY" -m pytest -v -rsP --durations=0 -p no:cacheprovider tests/gpu'
    # Under the sanitizer seed 0 only (no seed changes the order of stream accesses); not the
    # CUDA-graph refusal (no copy), nor the checks that a run gives its memory back.
    [sanitizer]='TORCH_CUDA_SANITIZER=1 "$PY" -m pytest -v -rs --durations=0 -p no:cacheprovider tests/gpu -k "not pp4_stage0 and not saved_twice and not -1- and not -2- and not captured_graph and not device_memory and not manager_behind"'
    [replay]='replay_stage 0 replay.json'
    [compare]='"$PY" bench/megatron_compare.py --layers 8 --hidden 4096 --heads 32 --seq 4096 --microbatches 4 $COMPARE_COMMON --modules core_attn,qkv_linear --modules $FIVE_MODULES --json "$OUT_DIR/compare.json"'
    [compare_host]='"$PY" bench/megatron_compare.py --layers 16 --hidden 1024 --heads 8 --seq 1024 --microbatches 8 $COMPARE_COMMON --modules $FIVE_MODULES --module-groups --warmup 5 --profile ${COMPARE_HOST_PROFILE:-0} --json "$OUT_DIR/compare_host.json"'
    # The last stage on deterministic kernels: bit-for-bit losses and grads rows for both engines (no timing).
    [replay_last]='replay_stage 3 replay_last.json --deterministic'
    # README's co-plan, stage 0: attn_norm,qkv_linear offloaded, core attention recomputed.
    [replay_coplan]='"$PY" -m chunk_offload.replay --pp 2 --stage 0 --layers 8 --hidden 1024 --heads 16 --seq 4096 --microbatches 8 --micro-batch-size 1 --vocab 32000 --dtype bf16 --attention local --modules attn_norm,qkv_linear --recompute-modules core_attn --iterations 3 --warmup 1 --json "$OUT_DIR/replay_coplan.json"'
    [bandwidth]='"$PY" bench/bandwidth.py --json "$OUT_DIR/bandwidth.json"'
    [overhead]='"$PY" bench/overhead.py --repeats 20 --profile 3'
    [sanitizer_pp4]='TORCH_CUDA_SANITIZER=1 "$PY" -m pytest -v -rs -p no:cacheprovider tests/gpu/test_cuda_replay.py -k pp4_stage0'
)
# Issue 26's configurations: compute-bound (hidden 4096, both module sets), then host-bound (hidden 1024, the five
# modules; module groups too; 5 warm-up steps: a budget may split layer groups twice, NOTE [Budget splits layer groups]).
readonly COMPARE_COMMON='--micro-batch-size 1 --vocab 32000 --dtype bf16 --attention sdpa --min-offload-bytes 1048576 --warmup 3 --iterations 4'
readonly FIVE_MODULES='attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm'
export COMPARE_COMMON FIVE_MODULES
# What the function steps run, for the plan that --dry-run prints.
declare -A DESCRIBE=(
    [install]='"$PY" -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl (when .whl/ has wheels)'
    [env]='date, git rev-parse HEAD, nvidia-smi, python/torch/CUDA/device, megatron-core/numpy/pytest versions'
    [replay]='"$PY" -m chunk_offload.replay --pp 4 --vpp 2 --stage 0 --microbatches 8 --layers 32 --hidden 4096 --heads 32 --seq $REPLAY_SEQS (first that fits) --micro-batch-size 1 --vocab 32000 --dtype bf16 --modules $REPLAY_MODULES --iterations 3 --warmup 1 --attention sdpa [--compare megatron --budget-bytes megatron where --help lists them] --json "$OUT_DIR/replay.json"'
    [replay_last]='the same as replay with --stage 3 (the last stage) --deterministic --json "$OUT_DIR/replay_last.json"'
)
readonly LOG_HALF_BYTES=$((1 << 20))  # a step's log above 2 MiB keeps its first and last MiB
readonly DEFAULT_BUDGET=540           # seconds for every step together (issue 22: under 9 minutes)
readonly MIN_STEP=15                  # a step with less of the budget left is skipped

usage() {
    cat <<EOF
usage: bash bench/gpu_evidence.sh [--dry-run] [--out DIR] [--only STEP[,STEP...]] [--budget SECONDS] [--fetch-wheels] [--help]

  --dry-run        print the steps and their commands, run nothing
  --out DIR        where logs and JSON go (default: \$OUT, else ./out)
  --only STEPS     run only these steps, in the usual order; steps: ${STEPS[*]}
  --budget SECONDS every step within this many seconds together (default $DEFAULT_BUDGET); a step's
                   limit is cut to what is left, a step with under ${MIN_STEP}s left is skipped
  --fetch-wheels   download the wheels to carry into .whl/ (needs network) and exit
  --help           this text
EOF
}

usage_error() {
    echo "gpu_evidence.sh: $1" >&2
    usage >&2
    exit 2
}

install_wheels() {
    shopt -s nullglob
    local wheels=(.whl/*.whl)
    if [[ ${#wheels[@]} -eq 0 ]]; then
        echo "no wheels in .whl/: using what is installed"
        return 0
    fi
    "$PY" -m pip install -q --no-index --no-deps --upgrade --target /tmp/site "${wheels[@]}" && printf 'installed %s\n' "${wheels[@]}"
}

print_environment() {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "command: $COMMAND_LINE"
    echo "git commit: $(git rev-parse HEAD 2>/dev/null || echo '(no git metadata in this copy)')"
    git status --short 2>/dev/null | head -20
    nvidia-smi || echo "nvidia-smi failed"
    "$PY" - <<'PY'
import importlib.metadata as metadata
import platform

import torch

print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs")
for dist in ("megatron-core", "numpy", "pytest", "transformer-engine"):
    try:
        print(f"{dist} {metadata.version(dist)}")
    except metadata.PackageNotFoundError:
        print(f"{dist}: not installed")
PY
}

replay_stage() {
    local stage=$1 json=$2 extra=(--attention sdpa) seq rc help flag
    shift 2
    help=$("$PY" -m chunk_offload.replay --help 2>/dev/null)
    for flag in "$@"; do  # further options, where this replay has them
        [[ $help == *"$flag"* ]] && extra+=("$flag")
    done
    if [[ $help == *--compare* ]]; then
        extra+=(--compare megatron)
    fi
    if [[ $help == *--budget-bytes* ]]; then
        extra+=(--budget-bytes megatron)  # issue 26: the same stage at megatron's peak (a fourth build)
    fi
    echo "extra options: ${extra[*]}"
    for seq in ${REPLAY_SEQS:-4096 2048 1024}; do
        echo "+ stage $stage, seq $seq"
        "$PY" -m chunk_offload.replay --pp 4 --vpp 2 --stage "$stage" --microbatches 8 --layers 32 --hidden 4096 --heads 32 \
            --seq "$seq" --micro-batch-size 1 --vocab 32000 --dtype bf16 --modules "${REPLAY_MODULES:-core_attn,qkv_linear}" \
            --iterations 3 --warmup 1 "${extra[@]}" --json "$OUT_DIR/$json"
        rc=$?
        [[ $rc -ne 3 ]] && return "$rc"
        echo "seq $seq does not fit on the device (exit 3: out of memory); trying a shorter one"
    done
    return 3
}

fetch_wheels() {
    mkdir -p .whl
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || grep -qx '/.whl/' .gitignore || echo '/.whl/' >>.git/info/exclude
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
        megatron-core==0.19.2
}

# Append a step's log to evidence.log, keeping its first and last MiB when it is longer.
append_log() {
    local file=$1 size
    size=$(wc -c <"$file")
    if ((size > 2 * LOG_HALF_BYTES)); then
        head -c "$LOG_HALF_BYTES" "$file"
        printf '\n[... %d bytes left out ...]\n' $((size - 2 * LOG_HALF_BYTES))
        tail -c "$LOG_HALF_BYTES" "$file"
    else
        cat "$file"
    fi >>"$OUT_DIR/evidence.log"
}

# A step left out for lack of budget: its line in summary.txt and evidence.log.
skip_step() {
    local name=$1 left=$2
    echo "=== $name: skipped, ${left}s of the budget left"
    printf '=== step %s: %s\n=== skipped: %ss of the %ss budget left (under %ss)\n' "$name" "${CMD[$name]}" "$left" "$BUDGET" "$MIN_STEP" >>"$OUT_DIR/evidence.log"
    printf '%-10s %-28s %5ss of %ss\n' "$name" "skipped (budget)" 0 "$left" >>"$OUT_DIR/summary.txt"
}

# Run step $1 under limit $2, its output into file $3 (and to the terminal unless $4 is "quiet");
# "exit-status seconds" into $3.rc.
exec_step() {
    local name=$1 limit=$2 log=$3 start rc
    start=$(date +%s)
    if [[ ${4:-} == quiet ]]; then
        timeout --kill-after=15 "$limit" bash -o pipefail -c "${CMD[$name]}" >"$log" 2>&1
        rc=$?
    else
        echo "=== $name (limit ${limit}s): ${CMD[$name]}"
        timeout --kill-after=15 "$limit" bash -o pipefail -c "${CMD[$name]}" 2>&1 | tee "$log"
        rc=${PIPESTATUS[0]}
    fi
    echo "$rc $(($(date +%s) - start))" >"$log.rc"
}

# What exec_step left for step $1 (limit $2, log $3) into evidence.log and summary.txt; status 0 if it passed.
record_step() {
    local name=$1 limit=$2 log=$3 rc seconds status
    read -r rc seconds <"$log.rc"
    case $rc in
        0) status=ok ;;
        124 | 137) status="timed out after ${limit}s" ;;
        *) status="failed (exit $rc)" ;;
    esac
    {
        echo "=== step $name: ${CMD[$name]}"
        echo "=== limit ${limit}s, took ${seconds}s, $status"
    } >>"$OUT_DIR/evidence.log"
    append_log "$log"
    rm -f "$log" "$log.rc"
    printf '%-10s %-28s %5ss of %ss\n' "$name" "$status" "$seconds" "$limit" >>"$OUT_DIR/summary.txt"
    echo "=== $name: $status in ${seconds}s"
    [[ $rc -eq 0 ]]
}

# Steps "$@" side by side, each under its limit cut to $LEFT; their outputs follow in order once all ended.
run_beside() {
    local name logs=() limits=() pids=() i failed=0 start
    start=$(date +%s)
    echo "=== side by side: $*"
    for name in "$@"; do
        logs+=("$(mktemp)")
        limits+=($((LEFT < LIMIT[$name] ? LEFT : LIMIT[$name])))
        exec_step "$name" "${limits[-1]}" "${logs[-1]}" quiet &
        pids+=($!)
    done
    wait "${pids[@]}"
    for i in "${!logs[@]}"; do
        cat "${logs[$i]}"
        record_step "${@:i+1:1}" "${limits[$i]}" "${logs[$i]}" || failed=1
    done
    printf '%-10s %-28s %5ss\n' "(beside)" "the $# above, side by side" $(($(date +%s) - start)) >>"$OUT_DIR/summary.txt"
    return "$failed"
}

print_plan() {
    echo "output folder: $OUT_DIR"
    local name total=0 beside=0
    for name in "${SELECTED[@]}"; do
        printf '%-10s (limit %ss%s): %s\n' "$name" "${LIMIT[$name]}" "$([[ $BESIDE == *" $name "* ]] && echo ', side by side')" \
            "${DESCRIBE[$name]:-${CMD[$name]}}"
        if [[ $BESIDE == *" $name "* ]]; then
            beside=$((LIMIT[$name] > beside ? LIMIT[$name] : beside))
        else
            total=$((total + LIMIT[$name]))
        fi
    done
    echo "budget: ${BUDGET}s for every step together; by their limits at most $((total + beside))s (the side-by-side steps by the longest)"
}

main() {
    COMMAND_LINE="bash bench/gpu_evidence.sh $*"
    local dry_run=0 fetch=0 only=""
    OUT_DIR=${OUT:-out}
    BUDGET=$DEFAULT_BUDGET
    while [[ $# -gt 0 ]]; do
        case $1 in
            --dry-run) dry_run=1 ;;
            --fetch-wheels) fetch=1 ;;
            --out | --only | --budget)
                [[ $# -ge 2 && -n $2 && $2 != --* ]] || usage_error "$1 needs a value"
                case $1 in
                    --out) OUT_DIR=$2 ;;
                    --only) only=$2 ;;
                    --budget) BUDGET=$2 ;;
                esac
                shift
                ;;
            --budget=*) BUDGET=${1#--budget=} ;;
            --out=*) OUT_DIR=${1#--out=}; [[ -n $OUT_DIR ]] || usage_error "--out needs a value" ;;
            --only=*) only=${1#--only=}; [[ -n $only ]] || usage_error "--only needs a value" ;;
            -h | --help) usage; exit 0 ;;
            *) usage_error "unknown argument '$1'" ;;
        esac
        shift
    done
    [[ $BUDGET =~ ^[1-9][0-9]*$ ]] || usage_error "--budget: expected a whole number of seconds >= 1, got '$BUDGET'"
    SELECTED=("${STEPS[@]}")
    if [[ -n $only ]]; then
        local wanted name
        IFS=, read -r -a wanted <<<"$only"
        for name in "${wanted[@]}"; do
            [[ -n $name && -n ${LIMIT[$name]+set} ]] || usage_error "--only: unknown step '$name'; steps: ${STEPS[*]}"
        done
        SELECTED=()
        for name in "${STEPS[@]}"; do
            [[ ",$only," == *",$name,"* ]] && SELECTED+=("$name")
        done
    fi
    [[ $OUT_DIR == /* ]] || OUT_DIR=$PWD/$OUT_DIR  # relative to where the script was called from
    cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
    PY=${PYTHON:-python3}
    export PY OUT_DIR COMMAND_LINE
    export -f install_wheels print_environment replay_stage
    if ((fetch)); then
        fetch_wheels
        exit
    fi
    if ((dry_run)); then
        echo "dry run: nothing is run"
        print_plan
        exit 0
    fi
    if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        echo "no CUDA device (or no torch for $PY): nothing is run; the steps would be:"
        print_plan
        exit 0
    fi
    mkdir -p "$OUT_DIR" || usage_error "--out: cannot create '$OUT_DIR'"
    OUT_DIR=$(cd "$OUT_DIR" && pwd)
    export OUT_DIR
    # Wheels carried in .whl/ are installed to /tmp/site by the install step; later steps see them.
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    echo "# $COMMAND_LINE" >>"$OUT_DIR/summary.txt"
    local failed=0 name began beside=() log
    began=$(date +%s)
    for name in "${SELECTED[@]}"; do
        [[ $BESIDE == *" $name "* ]] && beside+=("$name")
    done
    for name in "${SELECTED[@]}"; do
        [[ $BESIDE == *" $name "* && $name != "${beside[0]}" ]] && continue  # ran with the first of them
        LEFT=$((BUDGET - ($(date +%s) - began)))
        if ((LEFT < MIN_STEP)); then
            if [[ $name == "${beside[0]:-}" ]]; then
                for log in "${beside[@]}"; do skip_step "$log" "$LEFT"; done
            else
                skip_step "$name" "$LEFT"
            fi
            failed=1
        elif [[ $name == "${beside[0]:-}" && ${#beside[@]} -gt 1 ]]; then
            run_beside "${beside[@]}" || failed=1
        else
            log=$(mktemp)
            exec_step "$name" $((LEFT < LIMIT[$name] ? LEFT : LIMIT[$name])) "$log"
            record_step "$name" $((LEFT < LIMIT[$name] ? LEFT : LIMIT[$name])) "$log" || failed=1
        fi
    done
    printf '%-10s %-28s %5ss of %ss\n' "(total)" "every step" $(($(date +%s) - began)) "$BUDGET" >>"$OUT_DIR/summary.txt"
    cat "$OUT_DIR/summary.txt"
    exit "$failed"
}

main "$@"
