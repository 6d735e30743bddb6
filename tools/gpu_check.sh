#!/usr/bin/env bash
# The GPU checks of megatron-sat in one offline script, at most ~8 minutes on one H100/H200:
#   bash tools/gpu_check.sh [OUT_DIR]                 (OUT_DIR default: $OUT, else runs/gpu_check)
#
# Works on a bare GPU machine with torch and no internet (e.g. the lent H200: Python 3.12, torch 2.11, no
# megatron-core, no Transformer Engine). What the project needs beyond torch and is missing there is installed
# from a wheel folder prepared beforehand on a machine with internet (git-ignored; `make gpu-wheels`):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.19.2 psutil xxhash tqdm
# into a private folder under $TMPDIR (never into the system Python, never from the network).
# MSAT_WHEELS names another wheel folder; PYTHON another interpreter.
#
# 1. tests/test_gpu.py: every arch on the local spec in BF16 on CUDA; with Transformer Engine also the TE spec
#    equal to the local one (SATFormer keeping TE's fused LayerNormColumnParallelLinear), FP8, the distributed
#    optimizer resumed from a checkpoint. TE tests are skipped with their reason when TE is absent.
# 2. tools/benchmark_step.py at the 760M and 1.3B shapes, BF16, seq 4096, one micro-batch: tokens/s, MFU, peak
#    memory, and the SATFormer (and satformer:separate, when that variant exists) / Transformer ratios,
#    interleaved in one process (goal: <= 1.02). FP8 ratios too where TE is present.
# 3. tools/gpu_steptime_check.py: bf16 GEMM throughput at the 760M / 1.3B layer shapes and step 2's measured
#    micro-batches against the step-time model's predictions for this GPU's gpus.json row (docs/step_time.md).
# Figures land in OUT_DIR (summary.txt, *.json, *.log). Exit: 0 all ran, 1 a check failed, 2 cannot start.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-runs/gpu_check}}
wheels=${MSAT_WHEELS:-.whl}
py=${PYTHON:-python3}
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA device visible to $py (torch missing or CPU-only); run it on a GPU machine" >&2
  exit 2
fi
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }
status=0

# --- offline dependencies: module name -> wheel (project name) ------------------------------------------------
missing=()
for pair in megatron.core:megatron-core psutil:psutil xxhash:xxhash tqdm:tqdm pytest:pytest; do
  "$py" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair##*:}")
done
if ((${#missing[@]})); then
  if [[ ! -d "$wheels" ]]; then
    echo "gpu_check: missing ${missing[*]} and no wheel folder '$wheels'; prepare one with the pip download line" \
         "at the top of tools/gpu_check.sh (or make gpu-wheels) and pass it along (MSAT_WHEELS=DIR)" >&2
    exit 2
  fi
  site="${TMPDIR:-/tmp}/megatron-sat-gpu-site"  # outside OUT_DIR: a device run's OUT comes back, the wheels need not
  if ! "$py" -m pip install -q --upgrade --no-index --no-deps --find-links "$wheels" --target "$site" "${missing[@]}"; then
    echo "gpu_check: could not install ${missing[*]} from $wheels (offline); is every wheel there, for $("$py" -V)?" >&2
    exit 2
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  say "installed offline from $wheels: ${missing[*]}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$py" - <<'EOF' 2>&1 | tee -a "$summary"
import torch, megatron.core
print("torch", torch.__version__, "| CUDA", torch.version.cuda, "|", torch.cuda.get_device_name(),
      "| megatron-core", megatron.core.__version__)
try:
    import transformer_engine
    print("transformer-engine", transformer_engine.__version__)
except Exception as e:
    print(f"transformer-engine not importable ({type(e).__name__}): TE and FP8 checks are skipped; figures are "
          "from the local spec (torch SDPA attention)")
EOF
have_te=$("$py" -c "import transformer_engine" 2>/dev/null && echo 1 || echo 0)

# --- 1. GPU tests (about 3 minutes) -------------------------------------------------------------------------------
say "== tests/test_gpu.py"
timeout 240 "$py" -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py >"$out/test_gpu.log" 2>&1
rc=$?
tail -n 25 "$out/test_gpu.log"
say "tests/test_gpu.py: exit $rc ($(tail -n 1 "$out/test_gpu.log"))"
((rc == 0)) || status=1

# --- 2. step benchmark at the paper's 760M and 1.3B shapes (about 2 minutes each) ----------------------------------
archs="transformer satformer"
"$py" -c "from megatron_sat.archs import ARCH_VARIANTS as v; assert 'separate' in v" 2>/dev/null \
  && archs="$archs satformer:separate"
precisions=(--bf16)
((have_te)) && precisions+=(--fp8)
for scale in 760M 1.3B; do
  for precision in "${precisions[@]}"; do
    name="benchmark_${scale}_${precision#--}"
    say "== $name: $archs"
    # shellcheck disable=SC2086
    timeout 180 "$py" tools/benchmark_step.py --scale "$scale" --seq-length 4096 --micro-batch-size 1 --bf16 \
      $( [[ $precision == --fp8 ]] && echo "--fp8-format hybrid" ) --archs $archs --rounds 8 --warmup 2 \
      --json "$out/$name.json" >"$out/$name.log" 2>&1
    rc=$?
    sed -n '/^arch /,$p' "$out/$name.log" | tee -a "$summary"
    if ((rc != 0)); then
      say "$name: exit $rc"; tail -n 15 "$out/$name.log"; status=1
    fi
  done
done
# --- 3. the step-time model against this GPU (about a minute) --------------------------------------------------------
say "== step-time model: GEMMs at the models' shapes and the benchmarked micro-batches, measured against predicted"
timeout 120 "$py" tools/gpu_steptime_check.py --benchmarks "$out"/benchmark_*_bf16.json \
  --output "$out/steptime_check.json" >"$out/steptime_check.log" 2>&1
rc=$?
tee -a "$summary" <"$out/steptime_check.log"
((rc == 0)) || { say "gpu_steptime_check: exit $rc"; status=1; }
say "gpu_check: done, exit $status; figures in $out"
exit $status
