#!/usr/bin/env bash
# chunk-offload vs megatron-core's built-in fine-grained activation offloading on one GPU
# (issue 26): bench/megatron_compare.py at the sizes (megatron-core 0.16.1), then the
# stage replay's --compare megatron on stage 0 of a PP=4 job under 0.16.1 and 0.19.2.
# The replay runs fp32: its bf16 build is being fixed (build_gpt_chunks dtype handling).
# Expects the wheels in .whl-0.16.1/ and .whl-0.19.2/ (ignored, carried: see /work/shared/GPU.md, step 1):
#   for v in 0.16.1 0.19.2; do python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d .whl-$v megatron-core==$v; done
# Writes every table and JSON to $OUT.
#
#   OUT=out bash bench/megatron_compare_gpu.sh
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
for v in 0.16.1 0.19.2; do
  python3 -m pip install -q --no-index --no-deps --target "/tmp/site-$v" .whl-"$v"/*.whl
done
status=0
step() {  # name seconds python-args...
  local name=$1 seconds=$2 start=$SECONDS
  shift 2
  timeout "$seconds" python3 "$@" > "$OUT/$name.txt" 2> "$OUT/$name.err" || status=$?
  grep -v -i warn "$OUT/$name.txt"
  echo "== $name: $((SECONDS - start)) s, status $status"
  tail -n 3 "$OUT/$name.err" | grep -v -i warn
}
export PYTHONPATH="/tmp/site-0.16.1:$PWD"
step bench_large 300 bench/megatron_compare.py --layers 8 --hidden 4096 --heads 32 --seq 4096 --micro-batch-size 1 \
  --microbatches 4 --vocab 32000 --dtype bf16 --attention sdpa --min-offload-bytes 1048576 --warmup 2 --iterations 4 \
  --modules core_attn,qkv_linear --modules attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm --json "$OUT/bench_large.json"
step bench_host_bound 120 bench/megatron_compare.py --layers 16 --hidden 1024 --heads 8 --seq 1024 --micro-batch-size 1 \
  --microbatches 8 --vocab 32000 --dtype bf16 --attention sdpa --min-offload-bytes 1048576 --warmup 2 --iterations 4 \
  --modules core_attn,qkv_linear --modules attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm --json "$OUT/bench_host_bound.json"
for v in 0.16.1 0.19.2; do
  PYTHONPATH="/tmp/site-$v:$PWD" step "replay_compare_$v" 90 -m chunk_offload.replay --pp 4 --stage 0 --layers 16 \
    --hidden 2048 --heads 16 --seq 2048 --microbatches 8 --vocab 32000 --dtype fp32 --modules core_attn,qkv_linear \
    --iterations 3 --warmup 1 --compare megatron --json "$OUT/replay_compare_$v.json"
done
exit "$status"
