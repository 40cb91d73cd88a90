#!/usr/bin/env bash
# The GPU window in one or two calls of a lent machine (10 minutes a command; about 15 minutes of device time in all,
# machine start included; no network there). bench/README.md ("A GPU window, step by step") says when to call what.
#
#   bash bench/device_wheels.sh               # here, right before: wheels into .whl/ and the commit stamp
#   bash bench/gpu_session.sh                 # call 1 (timeout 600 s, carry .whl): the window
#   bash bench/gpu_session.sh rest compile,w4 # call 2, only if call 1 dropped sections and time is left
#
# Stages:
#   window (default)  python -m bench session (budget $BUDGET, default 480 s: 8 minutes), then the test suite in
#                     whatever is left of $CALL_LIMIT (default 570 s from this script's start, so the command ends
#                     inside the 10-minute limit with its files)
#   rest SECTIONS     python -m bench session --sections SECTIONS (what call 1 dropped; it printed them), results as
#                     session-rest.json, in what is left of $CALL_LIMIT less 60 s ($BUDGET overrides); then the suite
#   suite             only the test suite
#   w5                python -m bench w5: the 0.5B architecture at 24 GiB, stock TRL vs fastrl with both memory options
#   smoke             python -m bench session --smoke (runs on a CPU too: the plumbing)
#
# The suite is the README's test command without xdist (one process: eight workers sharing one GPU made failures
# that may be contention), the CUDA test files first, `-v` so that every test's verdict is in the log as it
# finishes (a run cut by its limit still names its failures); suite-failures.txt lists them.
# Files under $OUT (the device tool returns at most 8, 16 MiB each): <stage>.log, <stage>.tgz (the session's JSON
# and rows, the suite's log) and suite-failures.txt. Unpack here with
#   d=bench/results/<gpu-slug>/<date>-<commit>; mkdir -p $d && tar xzf <stage>.tgz -C $d
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
STAGE="${1:-window}"
OUT="${OUT:-$(mktemp -d)}"
CALL_LIMIT="${CALL_LIMIT:-570}"
RES="$(mktemp -d)/$STAGE"
mkdir -p "$OUT" "$RES"
LOG="$OUT/$STAGE.log"
export PYTHONUNBUFFERED=1
left() { echo $((CALL_LIMIT - (SECONDS - T0))); }
exec > >(tee -a "$LOG") 2>&1  # everything to the log and to the caller

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
python3 - <<'PY' || exit 1
from importlib.metadata import PackageNotFoundError, version
import torch
from bench.provenance import provenance
print("torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA")
for name in ("triton", "transformers", "trl", "accelerate", "liger-kernel", "datasets"):
    try:
        print(name, version(name))
    except PackageNotFoundError:  # a section that needs it says so in its rows
        print(name, "missing")
print("fastrl", provenance())
PY

suite() {  # the test suite in what is left of the call, CUDA files first; every verdict in the log as it comes
    local limit=$(($(left) - 15))
    if [ "$limit" -lt 30 ]; then
        echo "suite: not run (${limit} s left of the call)"
        return 0
    fi
    echo "suite: python -m pytest -v (no xdist), ${limit} s"
    timeout "$limit" python3 -m pytest -v -p no:cacheprovider -rfE --durations=15 \
        tests/test_cuda_kernels.py tests/test_cuda.py tests >"$RES/suite.log" 2>&1
    local rc=$?
    [ "$rc" = 124 ] && echo "suite: stopped at its limit (${limit} s)" >>"$RES/suite.log"
    grep -E "(FAILED|ERROR)( |$)" "$RES/suite.log" | grep -v "^=" | sort -u >"$OUT/suite-failures.txt"
    tail -n 25 "$RES/suite.log"
    echo "suite: exit $rc, $(grep -c PASSED "$RES/suite.log") passed, $(wc -l <"$OUT/suite-failures.txt") failed" \
        "(names in suite-failures.txt)"
}

rc=0
case "$STAGE" in
    window)
        timeout $(($(left) - 30)) python3 -m bench session --budget "${BUDGET:-480}" --out "$RES" || rc=1
        suite ;;
    rest)
        if [ -n "${2:-}" ]; then
            timeout $(($(left) - 30)) python3 -m bench session --sections "$2" --name session-rest \
                --budget "${BUDGET:-$(($(left) - 60))}" --out "$RES" || rc=1
        fi
        suite ;;
    suite) suite ;;
    w5) timeout $(($(left) - 20)) python3 -m bench w5 --no-plots --out "$RES" --workload 0.5B --budget-mb 24576 \
            --providers trl,fastrl,fastrl+both || rc=1 ;;
    smoke) python3 -m bench session --smoke --out "$RES" || rc=1 ;;
    *) echo "unknown stage $STAGE (window, rest, suite, w5, smoke)"; exit 2 ;;
esac
tar czf "$OUT/$STAGE.tgz" -C "$RES" . && echo "results: $OUT/$STAGE.tgz ($(ls "$RES" | tr '\n' ' '))"
exit $rc
