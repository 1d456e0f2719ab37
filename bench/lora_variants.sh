#!/usr/bin/env bash
# Which LoRA plan is fastest on one 24 GB card? Runs LoRA variants of the deepseek-llm-7b shape on one GPU each,
# as many at a time as there are GPUs (each row on its own card, every rank capped at 24 GiB), then the fastest
# one with DDP on every GPU (its `scaling` is against that 1-GPU row of the same run). One JSON line per row in
# bench/results.jsonl (or $BENCH_RESULTS), logs under $BENCH_OUT.
#
#   bench/lora_variants.sh [--run_id ID] [--variants "flex-mb1 flex-mb2-ckpt sdpa-mb1"] [--no_ddp]
#
# Variants (all: bf16 frozen base, Liger kernels, no LoRA dropout, packed rows of 2048 tokens, 8192 tokens per
# optimizer step per GPU):
#   sdpa-mb1       sdpa attention (dense block-diagonal mask for packed rows), micro-batch 1, no checkpointing
#   flex-mb1       flex_attention (skips masked blocks), micro-batch 1, no checkpointing
#   flex-mb2-ckpt  flex_attention, micro-batch 2, activation checkpointing
#   flex-mb4-ckpt  flex_attention, micro-batch 4, activation checkpointing
#   flex-mb4-ckpt-skip3  the same, the last 3 of 30 layers not checkpointed (their recomputation skipped)
#   flex-mb2-ckpt-skip8  micro-batch 2 (x2 accumulation), the last 8 layers not checkpointed
#   flex-mb4-ckpt-compile  flex-mb4-ckpt under torch.compile (--torch_compile true)
#   flex-mb8-ckpt  flex_attention, micro-batch 8, activation checkpointing (16,384 tokens per step per GPU)
#   <variant>-peftcast  the variant with peft's own fp32 casts of the LoRA inputs (what sft skips under autocast)
# Rows that run side by side share the host's CPUs and memory bandwidth, not their GPUs (CUDA_VISIBLE_DEVICES; the
# single_gpu config leaves it alone). nvidia_smi_mem_gib is the peak of GPU 0 as NVML numbers it.
set -uo pipefail
cd "$(dirname "$0")/.."
RUN_ID="$(date -u +%Y%m%dT%H%M%SZ)-$(hostname | cut -c1-8)"
VARIANTS="flex-mb1 flex-mb2-ckpt"
DDP=1
while [ $# -gt 0 ]; do
  case $1 in
    --run_id) RUN_ID=$2; shift 2;;
    --variants) VARIANTS=$2; shift 2;;
    --no_ddp) DDP=0; shift;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
done
N=$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")
OUT=${BENCH_OUT:-output/bench/$RUN_ID}
RESULTS=${BENCH_RESULTS:-bench/results.jsonl}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / N ))}
COMMON=(--run_id "$RUN_ID" --out "$OUT" --results "$RESULTS" --model "${BENCH_MODEL:-deepseek-llm-7b}"
        --seq_len "${BENCH_SEQ_LEN:-2048}" --mem_cap_gib 24 --method lora --warmup 2 --steps 6 --timeout 420)
TRAIN=(--use_liger_kernel "${BENCH_LIGER_ON:-true}" --lora_dropout 0 --ddp_find_unused_parameters false)

shape() {  # variant -> train_throughput options, then "--", then sft options
  case $1 in
    sdpa-mb1) echo "--micro_batch 1 --grad_accum 4 -- --attn_implementation sdpa";;
    flex-mb1) echo "--micro_batch 1 --grad_accum 4 -- --attn_implementation flex_attention";;
    flex-mb2-ckpt) echo "--micro_batch 2 --grad_accum 2 -- --attn_implementation flex_attention --activation_checkpointing true";;
    flex-mb4-ckpt) echo "--micro_batch 4 --grad_accum 1 -- --attn_implementation flex_attention --activation_checkpointing true";;
    flex-mb4-ckpt-skip3) echo "--micro_batch 4 --grad_accum 1 -- --attn_implementation flex_attention --activation_checkpointing true --activation_checkpointing_skip_layers 3";;
    flex-mb2-ckpt-skip8) echo "--micro_batch 2 --grad_accum 2 -- --attn_implementation flex_attention --activation_checkpointing true --activation_checkpointing_skip_layers 8";;
    flex-mb4-ckpt-compile) echo "--micro_batch 4 --grad_accum 1 -- --attn_implementation flex_attention --activation_checkpointing true --torch_compile true";;
    flex-mb8-ckpt) echo "--micro_batch 8 --grad_accum 1 -- --attn_implementation flex_attention --activation_checkpointing true";;
    *-peftcast) shape "${1%-peftcast}";;  # the same, with peft's fp32 input casts (row() sets the switch)
    *) echo "unknown variant $1" >&2; return 2;;
  esac
}
row() {  # name gpu(s) strategy n_gpus variant [extra]
  local name=$1 gpus=$2 strategy=$3 n=$4 variant=$5; shift 5
  local spec; spec=$(shape "$variant") || return 2
  local bench_opts=${spec%% -- *} train_opts=${spec#* -- }
  case $variant in *-peftcast) local -x SFT_PEFT_INPUT_CAST=1;; esac  # sft/model.py: skip_input_casts_under_autocast
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$gpus python3 bench/train_throughput.py "${COMMON[@]}" --name "$name" --strategy "$strategy" \
    --n_gpus "$n" $bench_opts "$@" -- "${TRAIN[@]}" $train_opts
}

mkdir -p "$OUT"
echo "run_id $RUN_ID, variants: $VARIANTS, $N GPU(s), out $OUT"
set -- $VARIANTS
while [ $# -gt 0 ]; do  # one wave: a variant per GPU
  pids=()
  for g in $(seq 0 $(( N - 1 ))); do
    [ $# -gt 0 ] || break
    row "lora-1-$1" "$g" single 1 "$1" > "$OUT/wave-$1.txt" 2>&1 &
    pids+=($!); shift
  done
  wait "${pids[@]}"
done
for v in $VARIANTS; do grep -h "^\[bench\]" "$OUT/wave-$v.txt" | grep -v "accelerate.commands" | cut -c1-300; done

best=$(python3 -c "import json
rows=[json.loads(l) for l in open('$RESULTS') if l.strip()]
rows=[r for r in rows if r.get('run_id')=='$RUN_ID' and r.get('name','').startswith('lora-1-') and r.get('real_tok_s')]
print(max(rows, key=lambda r: r['real_tok_s'])['name'][len('lora-1-'):] if rows else '')")
if [ "$DDP" = 1 ] && [ "$N" -gt 1 ] && [ -n "$best" ]; then
  echo "fastest on one GPU: $best; now DDP on $N GPUs"
  row "lora-ddp-$best" "$(seq -s, 0 $(( N - 1 )))" ddp "$N" "$best" --scaling_of "lora-1-$best" \
    2>&1 | grep "^\[bench\]" | grep -v "accelerate.commands" | cut -c1-300
fi
python3 bench/report.py --run_id "$RUN_ID" --results "$RESULTS"
