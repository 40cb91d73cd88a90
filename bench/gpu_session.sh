#!/usr/bin/env bash
# One stage of the GPU measurements, sized for a lent machine that allows 10 minutes per command (device tool):
#
#   bash bench/device_wheels.sh                  # here, once: TRL, Liger, datasets, ... into .whl/ (ignored)
#   run(command="bash bench/gpu_session.sh check", carry=[".whl"])   # then core, sweeps, w4, ... (one call each)
#
# Each stage installs the carried wheels and fastrl itself (no network there), prints the device and versions,
# runs its commands under a time limit, tees everything to $OUT/<stage>.log and packs the result files into
# $OUT/<stage>.tgz (the device tool returns at most 8 files). Rows are also written as they finish
# (<name>.rows.jsonl), so a stage stopped by its limit still brings back what it measured. Unpack with
#   mkdir -p bench/results/<gpu-slug>/<stage> && tar xzf <stage>.tgz -C bench/results/<gpu-slug>/<stage>
#
# Stages, in the order that answers issue 9 soonest:
#   check   the CUDA kernel tests (compiled kernels against float64), then W1, W1-lp and W1-frozen: fastrl
#           (hybrid by default), fastrl-fused, fastrl-tfused (fully fused Triton kernels) and TRL
#   core    W2, W2-lp and W3 for the same providers
#   sweeps  the loss at 2k-16k tokens, H=4096 and H=896: fastrl-fused, fastrl-tfused, TRL
#   peers   W1 and W2 for torch (materialised), torch.compile and Liger
#   w4      python -m bench w4 (GRPOTrainer step, stock TRL vs fastrl, 4k-16k tokens)
#   w5      python -m bench w5, the 0.5B architecture at 24 GiB, stock TRL vs fastrl with both memory options
#   suite   the README's test command on the GPU machine (compiled kernels instead of the interpreter)
#   smoke   tiny shapes through the same plumbing (`bench gpu --smoke`); runs on a CPU too
#   next    issues 20-22 on the GPU: the CUDA tests of fused_divergence and the compiled ops, then
#           `bench keptset`, `bench divergence` and `bench compile` (CUDA graphs included), each under its own limit
# Then `python -m bench targets bench/results/<gpu-slug>` prints the targets over all stages' rows.
# STAGE_LIMIT (seconds, default 540) bounds each stage's measuring command.
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE="${1:?usage: bash bench/gpu_session.sh check|core|sweeps|peers|w4|w5|suite|smoke|next}"
OUT="${OUT:-$(mktemp -d)}"
LIMIT="${STAGE_LIMIT:-540}"
RES="$(mktemp -d)/$STAGE"
mkdir -p "$OUT" "$RES"
LOG="$OUT/$STAGE.log"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1

{
    # the wheels are for the GPU image's Python 3.12; elsewhere (a CPU smoke run) the installed packages serve
    if compgen -G ".whl/*.whl" >/dev/null && python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/site
    fi
    # fastrl.kernels is the kernels/ folder: an editable install maps it (no build isolation: no network)
    python3 -c "import fastrl.kernels" 2>/dev/null ||
        python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
    python3 - <<'EOF'
from importlib.metadata import PackageNotFoundError, version
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA")
for name in ("triton", "transformers", "trl", "accelerate", "liger-kernel", "datasets"):
    try:
        print(name, version(name))
    except PackageNotFoundError:  # a stage that needs it fails later with the real error
        print(name, "missing")
EOF
    git log -1 --format='fastrl commit %h %s' 2>/dev/null || true
} 2>&1 | tee "$LOG"
[ "${PIPESTATUS[0]}" = 0 ] || exit 1

P4=fastrl,fastrl-fused,fastrl-tfused,trl
gpu() { timeout "$LIMIT" python3 -m bench gpu --no-plots --out "$RES" "$@"; }
rc=0
case "$STAGE" in
    check)
        timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py tests/test_cuda.py \
            2>&1 | tee -a "$LOG" || rc=1
        LIMIT=$((LIMIT - 240))
        gpu --workload W1,W1-frozen --providers "$P4" 2>&1 | tee -a "$LOG" || rc=1 ;;
    core) gpu --workload W2,W3 --providers "$P4" 2>&1 | tee -a "$LOG" || rc=1 ;;
    sweeps) gpu --workload sweep-loss-h4096,sweep-loss-h896 --providers fastrl-fused,fastrl-tfused,trl 2>&1 |
        tee -a "$LOG" || rc=1 ;;
    peers) gpu --workload W1,W2 --providers torch,torch-compile,liger-fused,liger-triton 2>&1 | tee -a "$LOG" || rc=1 ;;
    w4) timeout "$LIMIT" python3 -m bench w4 --no-plots --out "$RES" 2>&1 | tee -a "$LOG" || rc=1 ;;
    w5) timeout "$LIMIT" python3 -m bench w5 --no-plots --out "$RES" --workload 0.5B --budget-mb 24576 \
            --providers trl,fastrl,fastrl+both 2>&1 | tee -a "$LOG" || rc=1 ;;
    smoke) gpu --smoke --workload W1,W3 --providers "$P4" 2>&1 | tee -a "$LOG" || rc=1 ;;
    suite) timeout "$LIMIT" python3 -m pytest -q -p no:cacheprovider 2>&1 | tee -a "$LOG" || rc=1 ;;
    next)
        timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_divergence.py tests/test_compile.py \
            tests/test_compile_divergence.py -k "cuda or compile" 2>&1 | tee -a "$LOG" || rc=1
        for cmd in keptset divergence; do
            timeout 130 python3 -m bench "$cmd" --out "$RES" 2>&1 | tee -a "$LOG" || rc=1
        done
        timeout 130 python3 -m bench compile --device cuda --out "$RES" 2>&1 | tee -a "$LOG" || rc=1 ;;
    *) echo "unknown stage $STAGE" | tee -a "$LOG"; exit 2 ;;
esac
tar czf "$OUT/$STAGE.tgz" -C "$RES" . && echo "results: $OUT/$STAGE.tgz ($(ls "$RES" | tr '\n' ' '))" | tee -a "$LOG"
exit $rc
