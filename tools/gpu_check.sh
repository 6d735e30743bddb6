#!/usr/bin/env bash
# The GPU checks of megatron-sat in one script, a few minutes on one H100/H200:
#   bash tools/gpu_check.sh [OUT_DIR]
# 1. tests/test_gpu.py: local spec in BF16 on CUDA; TE spec equal to the local spec; FP8 runs; the
#    distributed optimizer (FusedAdam) resumed from a checkpoint equals the uninterrupted run;
# 2. the same-layout step benchmark at 760M, BF16, seq 4096, every arch with ratios to the Transformer
#    (goal for SATFormer: time and peak-memory ratios <= 1.02; the paper has SATFormer 1.75x/1.82x the
#    throughput of Hyper-Connections/MUDDFormer with 31%/5% less memory), on the TE backend when TE
#    imports, else local.
# Uses the python on PATH (an NGC PyTorch container has TE and Apex); installs megatron-core if absent.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-runs/gpu_check}}
mkdir -p "$out"
python3 -c "import megatron.core" 2>/dev/null || python3 -m pip install -q --no-deps megatron-core==0.19.2
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
python3 -c "import transformer_engine; print('transformer-engine', transformer_engine.__version__)" \
  || echo "transformer-engine not importable: TE and FP8 tests will be skipped"
PYTHONPATH=. python3 -m pytest -q -rs tests/test_gpu.py 2>&1 | tee "$out/test_gpu.log"
PYTHONPATH=. python3 tools/benchmark_step.py --scale 760M --seq-length 4096 --micro-batch-size 1 --bf16 \
  --rounds 10 --json "$out/benchmark_760M.json" 2>&1 | tee "$out/benchmark_760M.log"
