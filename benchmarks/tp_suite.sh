#!/usr/bin/env bash
# The tensor-parallel checks and benchmarks on one machine of N GPUs, in one command (N = 2 or 4):
#
#     source .devtk/enter.sh && bash benchmarks/tp_suite.sh 2
#
# Runs, each step under its own time limit and whatever the others did:
#   1. pytest -m gpu tests/test_parallel.py  (NCCL, 2 ranks; with 4 GPUs 4 ranks too; CUDA-graph replay)
#   2. torchrun bench_tp.py                  (the 4096 -> 14336 -> 4096 MLP, 1 GPU vs N, M = 1 .. 4096)
#   3. torchrun bench_tp_decode.py           (Llama-3-8B-shaped decode, 1 GPU vs 2 (vs 4), batch 1 / 16)
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
# Writes to $OUT (else benchmarks/results/tp-suite-xN/), 8 files at most: tp-suite-xN.log (machine,
# steps, exit codes), tp-tests-xN.log, tp-mlp-xN.log, tp-decode-xN.log, and the benchmarks' own
# tp-mlp-<gpu>-xN.{json,md} and tp-decode-<gpu>-xN.{json,md}. Exits 1 if any step failed.
set -u
N="${1:?usage: bash benchmarks/tp_suite.sh <number of GPUs: 2 or 4>}"
case "$N" in 2|4) ;; *) echo "tp_suite.sh: the number of GPUs must be 2 or 4, got '$N'" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.." || exit 2
# This checkout's tilemm first (torchrun puts the script's folder, not the repository, on sys.path).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
if [ -z "${OUT:-}" ]; then export OUT="benchmarks/results/tp-suite-x$N"; fi
mkdir -p "$OUT"
SUITE="$OUT/tp-suite-x$N.log"
: > "$SUITE"
say() { echo "$*" | tee -a "$SUITE"; }

say "== tp_suite.sh $N  $(date -u +%FT%TZ)  commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
say "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST=$TORCH_SYMM_MEM_DISABLE_MULTICAST"
nvidia-smi -L 2>&1 | tee -a "$SUITE"
nvidia-smi topo -m 2>&1 | head -12 | tee -a "$SUITE"
python - "$N" <<'EOF' 2>&1 | tee -a "$SUITE"
import sys, torch, tilemm
print(f"tilemm from {tilemm.__file__}")
n = int(sys.argv[1])
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {torch.cuda.nccl.version()}, "
      f"{torch.cuda.device_count()} GPUs: {[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}")
if torch.cuda.device_count() < n:
    print(f"TP SUITE: FATAL: {n} GPUs asked for, {torch.cuda.device_count()} visible")
    sys.exit(1)
EOF
if [ "${PIPESTATUS[0]}" != 0 ]; then say "TP SUITE: FAILED before any step (see above)"; exit 1; fi

if [ "$N" = 4 ]; then SIZES=1,2,4; else SIZES=1,2; fi
declare -A RC SECONDS_OF
step() {  # step NAME LIMIT LOG command...
    local name=$1 limit=$2 log=$3; shift 3
    say "-- $name: $* (limit ${limit}s, log $(basename "$log"))"
    local t0=$SECONDS
    timeout --signal=TERM --kill-after=20 "$limit" "$@" > "$log" 2>&1
    local rc=$?
    RC[$name]=$rc; SECONDS_OF[$name]=$((SECONDS - t0))
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then say "   $name: TIMED OUT after ${limit}s"; fi
    say "   $name: exit $rc in ${SECONDS_OF[$name]}s"
    if [ "$rc" != 0 ]; then echo "   --- last lines of $(basename "$log") ---"; tail -n 25 "$log"; fi
}

step tests 150 "$OUT/tp-tests-x$N.log" \
    python -m pytest -m gpu -n 0 -q -p no:cacheprovider tests/test_parallel.py
step mlp 150 "$OUT/tp-mlp-x$N.log" \
    torchrun --nproc-per-node "$N" benchmarks/bench_tp.py --formats bf16,nvfp4-wo,mxfp4-wo,nvfp4,mxfp8 \
    --rows 1,16,1024,4096 --reps 30 --max-seconds 90
step decode 170 "$OUT/tp-decode-x$N.log" \
    torchrun --nproc-per-node "$N" benchmarks/bench_tp_decode.py --sizes "$SIZES" --layers 16 --batches 1,16 \
    --prompt 256 --tokens 64 --variants bf16,nvfp4-wo,mxfp4-wo --max-seconds 100

say "== summary (exit codes; 0 = passed)"
FAILED=0
for s in tests mlp decode; do
    say "   $s: exit ${RC[$s]} (${SECONDS_OF[$s]}s)"
    [ "${RC[$s]}" != 0 ] && FAILED=1
done
grep -h -E "passed|failed|error" "$OUT/tp-tests-x$N.log" | tail -n 3 | tee -a "$SUITE"
grep -h -E "NOT met|WRONG|FAILED|Skipped" "$OUT"/tp-mlp-*.md "$OUT"/tp-decode-*.md 2>/dev/null | head -n 20 | tee -a "$SUITE"
ls "$OUT" | tee -a "$SUITE"
if [ "$FAILED" = 1 ]; then say "TP SUITE: SOME STEPS FAILED"; exit 1; fi
say "TP SUITE: ALL STEPS PASSED"
