#!/usr/bin/env bash
# One H200 (or any CUDA GPU), under 8 minutes: the cuda backend's conformance suite, then every
# bench/bench_*.py. Results land in $RESULTS (default bench/gpu/results/<UTC time>/); the summary at the
# end lists every step with its exit status. Exit status: non-zero if any step failed.
#
#   bash bench/gpu/run.sh                 # from the repository root or anywhere
#   PYTHON=/path/to/python RESULTS=/tmp/out bash bench/gpu/run.sh
#
# Time budget: 465 s of steps in all. Environment <= 60 s, conformance <= 240 s, then the time left is
# shared evenly by the bench scripts (each capped at 60 s, Triton compiles included).
set -uo pipefail
DEADLINE=$((SECONDS + 465))

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]] && .venv/bin/python -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' \
        2>/dev/null; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
RESULTS="${RESULTS:-bench/gpu/results/$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$RESULTS"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # compiled kernels: this script is for a device
SUMMARY=()
FAILED=0

step() {  # step <name> <timeout s> <command...>: run, log, record the status
    local name="$1" limit="$2"; shift 2
    local t0=$SECONDS
    echo "== $name (limit ${limit}s)" | tee -a "$RESULTS/run.log"
    timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$RESULTS/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$RESULTS/$name.log" | tee -a "$RESULTS/run.log"
    SUMMARY+=("$(printf '%-40s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
    [[ $rc -ne 0 ]] && FAILED=1
    return 0
}

step environment 60 "$PYTHON" - <<'PY'
import torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory // 2**30, "GiB")
PY
command -v nvidia-smi >/dev/null && nvidia-smi >"$RESULTS/nvidia-smi.txt" 2>&1

# The smoke suite, one process per group of ops so that a timeout loses one group's report, not all of them.
# On a fresh machine most of this time is Triton compiling (the first device run, 2026-12-04: 251 s for the 33
# smoke cases of the five top-k / indexer ops, 6-23 s a case); `--suite quick` does not fit a 15-minute lease.
# Check that every kernel compiles before a lease: `python bench/gpu/compile_sm90.py` (no GPU needed).
CONF_DEADLINE=$((SECONDS + 240))
for ops in topk,indexer_topk,indexer_logits,fp8_indexer_topk,fp8_indexer_logits \
    fp8_quant_group,fp8_block_matmul,fp8_grouped_matmul,fp8_mla_cache_quant,fp8_sparse_mla_attention \
    sparse_mla_attention,silu_and_mul,linear_cross_entropy,dynamic_quant_int8 \
    w8a8_matmul,w4a8_matmul,grouped_matmul; do
    limit=$((CONF_DEADLINE - SECONDS))
    (( limit < 15 )) && { SUMMARY+=("conformance ${ops%%,*},... skipped: no time left"); FAILED=1; continue; }
    name="conformance_${ops%%,*}"
    step "$name" "$limit" "$PYTHON" -c 'from glm5.cli import main; main()' conformance --backend cuda \
        --suite smoke --ops "$ops" --json "$RESULTS/$name.json" --markdown "$RESULTS/$name.md"
done

# the device benches (on bench/_harness.py's `parse`: --runs, --json) first, then any other bench_*.py with
# its own defaults, so the device-relevant figures are in before the budget runs low. The CPU-only benches
# (bench_cpu_*.py, bench_quantize_stream.py, bench_invariant.py) measure this machine's CPU and are left to CPU runs.
DEVICE_RE='_harness import .*\bparse\b'
CPU_ONLY='bench_cpu_|bench_quantize_stream|bench_invariant\.py'
BENCHES=($(grep -lE "$DEVICE_RE" bench/bench_*.py) $(grep -LE "$DEVICE_RE" bench/bench_*.py | grep -vE "$CPU_ONLY"))
left=${#BENCHES[@]}
for bench in "${BENCHES[@]}"; do
    limit=$(( (DEADLINE - SECONDS) / left ))
    (( limit > 60 )) && limit=60
    (( limit < 5 )) && limit=5
    if grep -qE "$DEVICE_RE" "$bench"; then
        step "$(basename "$bench" .py)" "$limit" "$PYTHON" "$bench" --runs 10 --json "$RESULTS/benches.jsonl"
    else
        step "$(basename "$bench" .py)" "$limit" "$PYTHON" "$bench"
    fi
    left=$((left - 1))
done

echo "== summary ($RESULTS)"
printf '%s\n' "${SUMMARY[@]}" | tee -a "$RESULTS/run.log"
exit $FAILED
