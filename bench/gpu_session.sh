#!/usr/bin/env bash
# One call on a lent GPU machine (the device tool): install the carried wheels (.whl: ../shared/tools/
# device-wheels.sh plus torchao), show the machine, run the benchmark matrix within a time budget, and leave
# logs and the new result lines under $OUT. On your own GPU box, run bench/throughput.py directly.
#
#   bench/gpu_session.sh RUN_ID BUDGET_S [bench/throughput.py options...]
#   GPU_CHECKS="--strategies fsdp" bench/gpu_session.sh ...   # then bench/gpu_strategy_checks.py with those
#                                                               # options, in what is left of the budget
#   BENCH_LIGER=1 skips the Liger probe; BENCH_COMMIT names the commit where the tree has no git;
#   BENCH_TRACE_ROWS=row1,row2 brings those rows' profiled steps back as Chrome traces (ROW.trace.json.gz).
# A group may name check scripts (bench/throughput.py SCRIPTS): issue30's bench/qlora_check.py --fsdp two (2 GPUs,
# the FSDP QLoRA check), qlora-bytes' bench/fsdp_qlora_bytes.py (1 GPU). throughput.py runs them after the rows, in the
# time it keeps for them from --budget_s; their PASS/FAIL lines show below, their logs go into logs.tgz and their
# rows into results.jsonl. One alone: --rows fsdp-qlora-check.
set -uo pipefail
cd "$(dirname "$0")/.."
RUN_ID=$1; BUDGET_S=$2; shift 2
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >"$OUT/pip.txt" 2>&1 || { tail -20 "$OUT/pip.txt"; exit 1; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
export TORCH_EXTENSIONS_DIR=/tmp/torch-ext HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast here
# These VMs report a MemTotal that grows as memory is used (31 GiB at start on nvidia-h200-x2): tell the
# host-RAM check of offload plans the machine's real size.
export SFT_BENCH_HOST_RAM_GIB=${SFT_BENCH_HOST_RAM_GIB:-$(( $(nproc) * 8 ))}
export BENCH_RESULTS=$OUT/results.jsonl BENCH_OUT=/tmp/bench
export BENCH_TRACE_DIR=$OUT  # the rows BENCH_TRACE_ROWS names leave their profiled step's trace there
{
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  nvidia-smi topo -m
  python3 -c "import torch, transformers, accelerate, peft, deepspeed, torchao, liger_kernel, datasets; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'peft', peft.__version__, 'deepspeed', deepspeed.__version__, 'torchao', torchao.__version__, 'gpus', torch.cuda.device_count())"
  echo "cpus $(nproc), MemTotal $(grep MemTotal /proc/meminfo)"
} 2>&1 | grep -v Warning | tee "$OUT/machine.txt"
python3 -c "import transformers, accelerate, peft, datasets, deepspeed, torchao" 2>&1 | tail -3
[ "${PIPESTATUS[0]}" = 0 ] || { echo "imports failed: carry the missing wheels"; exit 1; }
if [ -z "${BENCH_LIGER:-}" ]; then
  python3 bench/liger_check.py 2>&1 | grep LIGER_ | tee "$OUT/liger.txt"
  grep -q LIGER_OK "$OUT/liger.txt" && export BENCH_LIGER=1 || export BENCH_LIGER=0
fi
echo "setup took $(( $(date +%s) - start ))s"

left=$(( BUDGET_S - ($(date +%s) - start) - ${CHECKS_S:-0} ))  # CHECKS_S: seconds kept for the checks
python3 bench/throughput.py --run_id "$RUN_ID" --budget_s "$left" --results "$BENCH_RESULTS" --out "$BENCH_OUT" "$@" 2>&1 | tee "$OUT/matrix.txt" | grep -E "^\[bench\]|^\[throughput\]|^run_id|^\||^not run| / " | cut -c1-400
if [ -n "${GPU_CHECKS:-}" ]; then
  left=$(( BUDGET_S - ($(date +%s) - start) - 15 ))
  echo "gpu strategy checks ($GPU_CHECKS), ${left}s left"
  if [ $left -gt 60 ]; then
    timeout $left python3 bench/gpu_strategy_checks.py $GPU_CHECKS --out /tmp/checks >"$OUT/gpu_checks.txt" 2>&1
    echo "gpu strategy checks exit $?"
    grep -E "^(PASS|FAIL)" "$OUT/gpu_checks.txt" | cut -c1-200
    tar czf "$OUT/checks.tgz" -C /tmp checks 2>/dev/null
  fi
fi
# (tar's --exclude applies to the names after it: before the ".", or the models' weights go in too)
tar czf "$OUT/logs.tgz" --exclude='*/output' --exclude='dataset-cache' --exclude='models' -C /tmp/bench . 2>/dev/null
ls -la "$OUT"
