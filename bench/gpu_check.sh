#!/usr/bin/env bash
# The GPU checks, prepared for when a CUDA machine is lent: in under 5 minutes, from the repository root,
#   bash bench/gpu_check.sh            (writes its output to stdout, and to $OUT/gpu_check.txt when OUT is set)
#   bash bench/gpu_check.sh --dry      (the same steps on the CPU: the CUDA tests skip, the table runs on tiny batches)
# 1. the device, torch, triton; 2. the CUDA tests (-m cuda: the host-sync budget of a Monitor step) and the Triton
# kernel against the eager rows on the GPU (tests/test_triton_stats.py); 3. one table (bench/gpu_table.py): bare vs
# full vs sentinel on the GPT-style and the ResNet-style bench models, CUDA events, the host syncs of one Monitor
# step (torch.cuda.set_sync_debug_mode); 4. the overhead of full and sentinel monitoring on the deep MLP and the
# GPT-style model, with Triton and with the eager path (AMPDOCTOR_TRITON=0), wall clock, interleaved rounds.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
dry=0
[ "${1:-}" = "--dry" ] && dry=1
log="${OUT:-/tmp}/gpu_check.txt"
{
  echo "== device"
  if [ $dry = 1 ]; then
    echo "dry run on the CPU: no GPU was used"
  else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
  fi
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')"
  python -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1
  echo "== tests (-m cuda: host syncs per Monitor step; Triton kernel exact on the GPU)"
  timeout 120 python -m pytest -q -p no:cacheprovider -m "cuda and not zoo" tests/test_cuda_syncs.py 2>&1 | tail -5
  [ $dry = 1 ] || timeout 120 python -m pytest -q -p no:cacheprovider -m "not zoo" tests/test_triton_stats.py 2>&1 | tail -5
  echo "== table: bare vs full vs sentinel (CUDA events; syncs of one Monitor step)"
  if [ $dry = 1 ]; then
    timeout 300 python bench/gpu_table.py --dry 2>&1 | tail -12
  else
    timeout 90 python bench/gpu_table.py --rounds 5 --steps 10 2>&1 | tail -12
    for triton in 1 0; do
      echo "== overhead, AMPDOCTOR_TRITON=$triton (wall clock, interleaved rounds)"
      AMPDOCTOR_TRITON=$triton timeout 60 python bench/bench_overhead.py --device cuda --rounds 5 --steps 10 \
        --models deep_mlp,gpt --variants "bare,ampdoctor full,ampdoctor sentinel" 2>&1 | tail -25
    done
  fi
} 2>&1 | tee "$log"
