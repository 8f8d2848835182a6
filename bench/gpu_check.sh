#!/usr/bin/env bash
# The GPU checks, prepared for when a CUDA machine is lent: in under 5 minutes, from the repository root,
#   bash bench/gpu_check.sh            (writes its output to stdout, and to $OUT/gpu_check.txt when OUT is set)
# 1. the device, torch, triton; 2. the Triton kernel against the eager rows on the GPU, and the host-sync
# budget of a Monitor step (tests/test_triton_stats.py, tests/test_cuda_syncs.py); 3. the overhead of full and
# sentinel monitoring on the deep MLP and the GPT-style model, with Triton and with the eager path
# (AMPDOCTOR_TRITON=0), wall clock, interleaved rounds; bench_overhead.py also prints the syncs of one step.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
log="${OUT:-/tmp}/gpu_check.txt"
{
  echo "== device"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  python -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1
  echo "== tests (Triton kernel exact on the GPU; host syncs per Monitor step)"
  timeout 120 python -m pytest -q -p no:cacheprovider -m "not zoo" \
    tests/test_triton_stats.py tests/test_cuda_syncs.py 2>&1 | tail -15
  for triton in 1 0; do
    echo "== overhead, AMPDOCTOR_TRITON=$triton (wall clock, interleaved rounds)"
    AMPDOCTOR_TRITON=$triton timeout 75 python bench/bench_overhead.py --device cuda --rounds 5 --steps 10 \
      --models deep_mlp,gpt --variants "bare,ampdoctor full,ampdoctor sentinel" 2>&1 | tail -25
  done
} 2>&1 | tee "$log"
