#!/usr/bin/env bash
# Stage replay on one GPU (issue 4.5): stage 0 of a PP=4, VPP=2 GPT job (32 layers, hidden 4096,
# 32 heads, bf16, 8 microbatches of 1 x seq tokens, torch's SDPA core attention; ATTENTION=local
# for megatron's), offloading core_attn,qkv_linear, then every dense module. Each run prints its
# table and writes it to $OUT/replay_<name>.{txt,json}.
#
# seq 4096 first; when the baseline does not fit (exit status 3: out of device memory) the run
# is retried with 2048, then 1024. Host memory: the pinned pool holds the offloaded bytes of the
# chunks in flight (~1.3 GB per layer for core_attn,qkv_linear at seq 4096, ~2.5 GB for all dense
# modules; stage 0 has up to 11 chunks x 4 layers in flight), so all dense modules at seq 4096
# may need more host memory than the machine has: set SEQS_DENSE to start lower.
#
#   bash bench/replay_gpu.sh            # from the repository root, megatron-core importable
set -u
OUT=${OUT:-out}
SEQS=${SEQS:-"4096 2048 1024"}
SEQS_DENSE=${SEQS_DENSE:-"2048 1024"}
ATTENTION=${ATTENTION:-sdpa}  # sdpa (flash / memory-efficient kernels) or local (megatron's s x s softmax)
mkdir -p "$OUT"

replay() {  # name modules seqs
  local name=$1 modules=$2 seqs=$3 seq rc
  for seq in $seqs; do
    python3 -m chunk_offload.replay --pp 4 --vpp 2 --stage 0 --microbatches 8 \
      --layers 32 --hidden 4096 --heads 32 --seq "$seq" --micro-batch-size 1 --vocab 32000 --dtype bf16 --attention "$ATTENTION" \
      --modules "$modules" --iterations 3 --warmup 1 --json "$OUT/replay_${name}.json" 2>&1 | tee "$OUT/replay_${name}.txt"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 3 ]; then return "$rc"; fi
    echo "seq $seq does not fit; trying a shorter one" | tee -a "$OUT/replay_${name}.log"
  done
  return 3
}

status=0
replay core_attn_qkv core_attn,qkv_linear "$SEQS" || status=$?
replay dense attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm,mlp_fc1 "$SEQS_DENSE" || status=$?
exit "$status"
