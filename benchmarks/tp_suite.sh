#!/usr/bin/env bash
# The tensor-parallel checks and benchmarks on one machine of N GPUs, in one command (N = 2 or 4):
#
#     source .devtk/enter.sh && bash benchmarks/tp_suite.sh 2
#     source .devtk/enter.sh && TP_STEPS="mlp host tests" bash benchmarks/tp_suite.sh 4
#
# TP_STEPS (default "probe mlp mlp2 decode tests"; "host" is extra) picks the steps, in their order below.
# Runs, each step under its own time limit and whatever the others did (at most about 8.5 minutes in
# all, cold kernel compiles included):
#   0. torchrun tp_probe.py                  (peer access, NCCL's transport with NCCL_DEBUG=INFO, the
#                                             all-reduce by size, NCCL vs the one-shot all-reduce)
#   1. torchrun bench_tp.py                  (the 4096 -> 14336 -> 4096 MLP, 1 GPU vs N, M = 1 .. 4096,
#                                             the all-reduce variants: TP_VARIANTS, default end, nccl,
#                                             oneshot, twoshot, ce4, mlpce4)
#   2. torchrun bench_tp_decode.py           (Llama-3-8B-shaped decode, 1 GPU vs 2 (vs 4), batch 1 / 16,
#                                             the one-shot all-reduce in graphs, and eagerly too (+1shot);
#                                             all 32 layers on 2 GPUs, 16 on 4)
#   h. torchrun tp_host.py                   (step "host": the host time of one M = 1 call, step by step,
#                                             and a cProfile)
#   3. pytest -m gpu tests/test_parallel.py  (NCCL, 2 ranks; with 4 GPUs 4 ranks only; CUDA-graph replay),
#                                             last, after the benchmarks have compiled what they share;
#                                             rank 0 prints each case, a hang prints every rank's stack
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
# Writes to $OUT (else benchmarks/results/tp-suite-xN/), 8 files at most: tp-suite-<gpu>-xN.log (machine,
# probe and NCCL transport lines, steps, exit codes), tp-tests-xN.log, tp-mlp-xN.log, tp-decode-xN.log,
# tp-host-xN.log, and the benchmarks' own tp-mlp-<gpu>-xN.{json,md}, tp-decode-<gpu>-xN.{json,md} and
# tp-host-<gpu>-xN.txt (more than 8 with every step: pick steps with TP_STEPS). Exits 1 if any step
# failed.
set -u
N="${1:?usage: bash benchmarks/tp_suite.sh <number of GPUs: 2 or 4>}"
case "$N" in 2|4) ;; *) echo "tp_suite.sh: the number of GPUs must be 2 or 4, got '$N'" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.." || exit 2
# This checkout's tilemm first (torchrun puts the script's folder, not the repository, on sys.path).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
if [ -z "${OUT:-}" ]; then export OUT="benchmarks/results/tp-suite-x$N"; fi
mkdir -p "$OUT"
# The suite's log is named as benchmarks/_results.py names results files (<gpu> as torch names it, slugged).
GPU_SLUG="$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>/dev/null | tr -s ' ' | tr '[:upper:] ' '[:lower:]-')"
SUITE="$OUT/tp-suite-${GPU_SLUG:-gpu}-x$N.log"
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

# Per machine size: decode sizes and layers, and the step limits (seconds; they add up to <= 500).
if [ "$N" = 4 ]; then
    SIZES=1,2,4; LAYERS=16; L_PROBE=30; L_MLP=140; L_MLP2=95; L_DECODE=130; L_TESTS=170; L_HOST=45
else
    SIZES=1,2; LAYERS=32; L_PROBE=40; L_MLP=140; L_MLP2=0; L_DECODE=165; L_TESTS=150; L_HOST=45
fi
STEPS=" ${TP_STEPS:-probe mlp mlp2 decode tests} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
say "steps:$STEPS"
declare -A RC SECONDS_OF
step() {  # step NAME LIMIT LOG command...
    local name=$1 limit=$2 log=$3; shift 3
    say "-- $name: $* (limit ${limit}s, log $(basename "$log"))"
    local t0=$SECONDS
    timeout --signal=TERM --kill-after=15 "$limit" "$@" > "$log" 2>&1
    local rc=$?
    RC[$name]=$rc; SECONDS_OF[$name]=$((SECONDS - t0))
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then say "   $name: TIMED OUT after ${limit}s"; fi
    say "   $name: exit $rc in ${SECONDS_OF[$name]}s"
    if [ "$rc" != 0 ]; then
        { echo "   --- last lines of $(basename "$log") ---"; tail -n 40 "$log"; } | tee -a "$SUITE"
    fi
}

# 0. The probe: its output and NCCL's transport lines go into the suite log (no file of its own).
if want probe; then
PROBE_LOG="$(mktemp)"
step probe "$L_PROBE" "$PROBE_LOG" env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH \
    torchrun --nproc-per-node "$N" benchmarks/investigations/tp_probe.py --reps 20
{
    echo "   --- probe: results ---"
    grep -E "TP PROBE" "$PROBE_LOG"
    echo "   --- probe: NCCL transport, channels, protocols (NCCL_DEBUG=INFO) ---"
    grep -E "NCCL INFO .*(via |Channel [0-9]+/[0-9]+ :|[0-9]+ coll channels|NVLS|P2P|SHM|CUMEM|Connected all|Using network|NCCL version|ncclCommInitRank|comm 0x|Init COMPLETE|nvlink|NVLink|Trees|Pattern|NCCL_)" \
        "$PROBE_LOG" | grep -v "^\s*$" | head -n 80
    grep -E "NCCL WARN|Traceback|Error" "$PROBE_LOG" | head -n 20
} 2>&1 | tee -a "$SUITE"
rm -f "$PROBE_LOG"
fi

# The all-reduce variants: one at the end (end, the default: NCCL eagerly, the one-shot all-reduce in
# graphs up to 256 KiB), NCCL everywhere (nccl, M <= 16), the one-shot all-reduce and amax exchange eagerly
# too (oneshot, M <= 16), the two-shot all-reduce (twoshot, M >= 1024), the copy engines overlapped with
# fc2's pieces (ce4) or with the whole MLP's (mlpce4). (NCCL overlapped, row4 / mlp2 / mlp4, and the copy
# engines in 8 or 6 tapered pieces, ce8 / ce6t, measured before: slower.)
VARIANTS=${TP_VARIANTS:-end,nccl,oneshot,twoshot,ce4,mlpce4}
want mlp && step mlp "$L_MLP" "$OUT/tp-mlp-x$N.log" \
    torchrun --nproc-per-node "$N" benchmarks/bench_tp.py --formats bf16,nvfp4-wo,mxfp4-wo,nvfp4,mxfp8 \
    --rows 1,16,1024,4096 --reps 20 --variants "$VARIANTS" --max-seconds $((L_MLP - 45))
# On 4 GPUs the MLP on 2 of them too, so that one machine gives both issues' figures.
if want mlp2 && [ "$L_MLP2" -gt 0 ]; then
    step mlp2 "$L_MLP2" "$OUT/tp-mlp-x2.log" \
        torchrun --nproc-per-node 2 benchmarks/bench_tp.py --formats bf16,nvfp4-wo,mxfp4-wo,mxfp8 \
        --rows 1,16,1024,4096 --reps 20 --variants "$VARIANTS" --max-seconds $((L_MLP2 - 40))
fi
want host && step host "$L_HOST" "$OUT/tp-host-x$N.log" \
    torchrun --nproc-per-node "$N" benchmarks/investigations/tp_host.py --formats bf16,nvfp4-wo,nvfp4 --reps 30 --profile-calls 200
want decode && step decode "$L_DECODE" "$OUT/tp-decode-x$N.log" \
    torchrun --nproc-per-node "$N" benchmarks/bench_tp_decode.py --sizes "$SIZES" --layers "$LAYERS" \
    --batches 1,16 --prompt 256 --tokens 64 --variants bf16,nvfp4-wo,nvfp4-wo+1shot,bf16+1shot,mxfp4-wo \
    --max-seconds $((L_DECODE - 55))
# The tests last (the benchmarks have warmed the kernel cache); -s shows rank 0's per-case lines, and
# every worker dumps its stack 20 s before the limit, so a hang leaves a traceback in the log.
# One machine size per run: the N-rank case only (the 2-rank one runs on the 2-GPU machine).
want tests && step tests "$L_TESTS" "$OUT/tp-tests-x$N.log" env TILEMM_TP_HANG_DUMP_AT=$(( $(date +%s) + L_TESTS - 20 )) \
    python -m pytest -s -m gpu -n 0 -q -p no:cacheprovider -o faulthandler_timeout=$((L_TESTS - 15)) \
    "tests/test_parallel.py::test_gpus_nccl[$N]"

say "== summary (exit codes; 0 = passed)"
FAILED=0
for s in probe mlp mlp2 host decode tests; do
    [ -z "${RC[$s]:-}" ] && continue
    say "   $s: exit ${RC[$s]} (${SECONDS_OF[$s]}s)"
    [ "${RC[$s]}" != 0 ] && FAILED=1
done
grep -h -E "passed|failed|error" "$OUT/tp-tests-x$N.log" 2>/dev/null | tail -n 3 | tee -a "$SUITE"
grep -h -E "NOT met|WRONG|FAILED|Skipped|unavailable|near-tie" "$OUT"/tp-mlp-*.md "$OUT"/tp-decode-*.md 2>/dev/null \
    | head -n 30 | tee -a "$SUITE"
ls "$OUT" | tee -a "$SUITE"
if [ "$FAILED" = 1 ]; then say "TP SUITE: SOME STEPS FAILED"; exit 1; fi
say "TP SUITE: ALL STEPS PASSED"
