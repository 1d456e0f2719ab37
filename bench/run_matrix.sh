#!/usr/bin/env bash
# The GPU benchmark matrix of issue 4 (one run_id for every row compared): deepseek-llm-7b shape, random init,
# Alpaca conversations packed to 2048 tokens, every rank capped at 24 GiB (emulating 24 GB cards).
#
#   bench/run_matrix.sh [--num_processes N] [--rows "lora full peer zero2 full22"] [--run_id ID] [--budget_s S]
#
# Rows: lora   LoRA on 1 GPU and with DDP on N GPUs (scaling = N-GPU tok/s / 1-GPU tok/s)
#       full   full fine-tune, FSDP2, bf16 weights + torchao 4-bit AdamW with bf16 stochastic rounding (the plan),
#              then the same with 8-bit AdamW states (full4 / full8: only one of them)
#       full22 the 4-bit plan with every rank capped at 22 GiB instead of 24 (only when asked): it runs when
#              PyTorch may never hold more than 22 GiB, what a 24 GB card leaves after the CUDA context and NCCL
#       peer   the peers' recipe: Trainer + ZeRO-3, optimizer and parameters offloaded to CPU, micro-batch 1 and 2
#              (peer1 / peer2: only micro-batch 1 / 2)
#       zero2  LoRA with ZeRO-2 in fp16 (dynamic loss scaling) on N GPUs
#       tp     (only when asked) tensor parallel against FSDP, full fine-tune of the deepseek-coder-1.3b shape with
#              fp32 master weights (too big for a replica per 24 GB card, fits sharded either way), same run;
#              tpfast: the pair with flex_attention (and Liger for FSDP); tp8: the pair at micro-batch 8
# N defaults to every visible GPU (2 on nvidia-h200-x2; use --num_processes 3 on the three-card box).
# Needs: torchao (full rows), liger-kernel, deepspeed. Results: one JSON line per row in bench/results.jsonl,
# logs under $BENCH_OUT (default output/bench/<run_id>); a table for the run_id is printed at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
N=$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")
ROWS="lora full peer zero2"
RUN_ID="$(date -u +%Y%m%dT%H%M%SZ)-$(hostname | cut -c1-8)"
BUDGET_S=3600
while [ $# -gt 0 ]; do
  case $1 in
    --num_processes) N=$2; shift 2;;
    --rows) ROWS=$2; shift 2;;
    --run_id) RUN_ID=$2; shift 2;;
    --budget_s) BUDGET_S=$2; shift 2;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
done
OUT=${BENCH_OUT:-output/bench/$RUN_ID}
RESULTS=${BENCH_RESULTS:-bench/results.jsonl}
DEADLINE=$(( $(date +%s) + BUDGET_S ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / N ))}
echo "run_id $RUN_ID, $N GPUs for multi-GPU rows, rows: $ROWS, out $OUT"

# bench ROW_TIMEOUT_S ARGS...: one row, within both its own timeout and what is left of the budget.
bench() {
  local want=$1; shift
  local left=$(( DEADLINE - $(date +%s) - 10 ))
  if [ $left -lt 60 ]; then echo "[matrix] skipped (budget spent): $*"; return 3; fi
  [ $want -gt $left ] && want=$left
  python3 bench/train_throughput.py --run_id "$RUN_ID" --out "$OUT" --results "$RESULTS" --timeout "$want" "$@"
}
has() { case " $ROWS " in *" $1 "*) return 0;; *) return 1;; esac; }
peak_of() {  # peak reserved GiB of row $1 in this run (empty if absent)
  python3 -c "import json,sys
rows=[json.loads(l) for l in open('$RESULTS') if l.strip()]
r=[x for x in rows if x.get('run_id')=='$RUN_ID' and x.get('name')=='$1']
print(r[-1]['peak_mem_gib'] if r else '')" 2>/dev/null
}

M7=(--model "${BENCH_MODEL:-deepseek-llm-7b}" --seq_len "${BENCH_SEQ_LEN:-2048}" --mem_cap_gib 24)  # BENCH_MODEL=tiny: a CPU smoke test
# LoRA: the fastest plan of bench/lora_variants.sh (README, Multi-GPU strategies): bf16 frozen base, Liger,
# flex_attention (skips the masked blocks of packed rows), micro-batch 4, activation checkpointing except the
# last 3 layers, no LoRA dropout (dropout would keep one more copy of every adapted layer's input).
# BENCH_LIGER=0 (set when bench/liger_check.py fails): rows run without Liger, LoRA with checkpointing instead.
LIGER=(); [ "${BENCH_LIGER:-1}" = 1 ] && LIGER=(--use_liger_kernel true)
LORA=(--method lora --micro_batch 4 --grad_accum 1 --warmup 2 --steps 6)
LORA_T=("${LIGER[@]}" --lora_dropout 0 --attn_implementation flex_attention --activation_checkpointing true
        --activation_checkpointing_skip_layers 3)
if [ ${#LIGER[@]} = 0 ]; then
  LORA=(--method lora --micro_batch 2 --grad_accum 2 --warmup 2 --steps 6)
  LORA_T=(--activation_checkpointing true)
fi
LORA_CKPT_T=(--activation_checkpointing true)  # the fallback when Liger is unavailable or fails
if has lora; then
  if [ ${#LIGER[@]} -gt 0 ] && bench 240 "${M7[@]}" "${LORA[@]}" --name lora-1 --strategy single --n_gpus 1 -- "${LORA_T[@]}"; then
    bench 240 "${M7[@]}" "${LORA[@]}" --name lora-ddp --strategy ddp --n_gpus "$N" --scaling_of lora-1 \
      -- "${LORA_T[@]}" --ddp_find_unused_parameters false
  else
    bench 240 "${M7[@]}" --method lora --micro_batch 2 --grad_accum 2 --warmup 2 --steps 6 --name lora-1-ckpt \
      --strategy single --n_gpus 1 -- "${LORA_CKPT_T[@]}" && \
    bench 240 "${M7[@]}" --method lora --micro_batch 2 --grad_accum 2 --warmup 2 --steps 6 --name lora-ddp-ckpt \
      --strategy ddp --n_gpus "$N" --scaling_of lora-1-ckpt -- "${LORA_CKPT_T[@]}" --ddp_find_unused_parameters false
  fi
fi

# Full fine-tune without offload: FSDP2 shards bf16 weights, bf16 gradients and 4-bit (or 8-bit) Adam states;
# the update is applied with stochastic rounding (torchao), so no fp32 master copy is needed. Gradient
# accumulation 1 (the measured setting; with more, sft turns sync_each_batch on so gradients stay sharded between
# micro-batches). Per rank on 2 GPUs: weights 6.4 GiB + gradients 6.4 + states 3.4 (4-bit) or 6.5 (8-bit);
# sft/lowbit.py makes torchao work under FSDP2 and updates the 210M-value embedding/lm_head shards in chunks.
FULL=(--method full --strategy fsdp --n_gpus "$N" --precision none --micro_batch 2 --grad_accum 1 --warmup 3 --steps 5)
FULL_T=(--dtype bfloat16 --activation_checkpointing true "${LIGER[@]}")
# 4-bit: torchao's own block size for 4-bit states (128; transformers would pass 256 to both optimizers).
FULL4=(--optim adamw_torch_4bit --optim_args bf16_stochastic_round=True,block_size=128)
FULL8=(--optim adamw_torch_8bit --optim_args bf16_stochastic_round=True)
full_ok=1
if has full || has full4; then
  bench 300 "${M7[@]}" "${FULL[@]}" --name full-fsdp-4bit -- "${FULL_T[@]}" "${FULL4[@]}" || full_ok=0
  peak=$(peak_of full-fsdp-4bit)
  python3 -c "import sys; sys.exit(0 if '$peak' and float('$peak') <= 22 else 1)" || full_ok=0
fi
# The peers' recipe (DeepSeek's finetune script, most blog posts): Trainer + ZeRO-3 with optimizer and
# parameters on the CPU (ds_configs/zero3_offload.json is that config), fp32 master weights, checkpointing on.
PEER=(--method full --strategy zero3_offload --peer zero3-offload-recipe --n_gpus "$N" --grad_accum 1 --warmup 1
      --steps 3)
if has peer || has peer1; then
  bench 300 "${M7[@]}" "${PEER[@]}" --name peer-mb1 --micro_batch 1 -- --activation_checkpointing true
fi
if has peer || has peer2; then
  bench 300 "${M7[@]}" "${PEER[@]}" --name peer-mb2 --micro_batch 2 -- --activation_checkpointing true
fi

# The 8-bit variant and the 22 GiB cap, after the peers' rows (the time budget may run out). full_ok says whether
# the 4-bit row fitted 22 GiB reserved.
[ "$full_ok" = 0 ] && echo "[matrix] full-fsdp-4bit failed or reserved more than 22 GiB"
if has full || has full8; then
  bench 300 "${M7[@]}" "${FULL[@]}" --name full-fsdp-8bit -- "${FULL_T[@]}" "${FULL8[@]}"
fi
if has full22; then
  bench 300 "${M7[@]}" --mem_cap_gib 22 "${FULL[@]}" --name full-fsdp-4bit-cap22 -- "${FULL_T[@]}" "${FULL4[@]}"
fi

# LoRA with ZeRO-2 in fp16 (dynamic loss scaling): fp16 frozen base.
if has zero2; then
  bench 240 "${M7[@]}" "${LORA[@]}" --name lora-zero2-fp16 --strategy zero2 --n_gpus "$N" --precision fp16 \
    -- "${LORA_T[@]}" --dtype float16
fi

# Tensor parallel: every layer split over the N GPUs (transformers' tp_plan) against FSDP sharding the same model.
# A 1.3B model (7B with fp32 master weights is ~55 GB per GPU even split over two), on 2 GPUs also on the
# three-card box: the 16 heads must divide by the TP size.
M13=(--model deepseek-coder-1.3b --seq_len "${BENCH_SEQ_LEN:-2048}" --mem_cap_gib 24 --method full --n_gpus 2
     --micro_batch 2 --grad_accum 1 --warmup 3 --steps 5)
if has tp; then  # sdpa, micro-batch 2
  bench 300 "${M13[@]}" --name fsdp-1.3b --strategy fsdp -- --activation_checkpointing true
  bench 300 "${M13[@]}" --name tp-1.3b --strategy tp -- --activation_checkpointing true
fi
if has tpfast; then  # the kernels of our fast plans: flex_attention, and Liger's fused loss and norms (not under TP:
  # its fused loss cannot take the sharded lm_head, and sft refuses the pair)
  bench 300 "${M13[@]}" --name fsdp-1.3b-flex --strategy fsdp -- "${LIGER[@]}" --attn_implementation flex_attention \
    --activation_checkpointing true
  bench 300 "${M13[@]}" --name tp-1.3b-flex --strategy tp -- --attn_implementation flex_attention \
    --activation_checkpointing true
fi
if has tp8; then  # micro-batch 8: four times the work per step for the same per-step overheads
  bench 300 "${M13[@]}" --micro_batch 8 --name fsdp-1.3b-mb8 --strategy fsdp -- --activation_checkpointing true
  bench 300 "${M13[@]}" --micro_batch 8 --name tp-1.3b-mb8 --strategy tp -- --activation_checkpointing true
fi

python3 bench/report.py --run_id "$RUN_ID" --results "$RESULTS"
