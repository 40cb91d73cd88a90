#!/usr/bin/env bash
# The GPU window in one or two calls of a lent machine (docs/gpu-window.md: the plan, cuts and faults):
#   bash bench/device_wheels.sh                  # here, right before: wheels into .whl/ and the commit stamp
#   bash bench/gpu_session.sh                    # call 1 (timeout 600 s, carry .whl): tests, then the session
#   bash bench/gpu_session.sh rest SECONDS [SECTIONS]  # call 2: SECONDS = device seconds left in the window
#   bash bench/gpu_session.sh w5|smoke           # bench w5 at 24 GiB | the session's plumbing (runs on a CPU too)
# Every file goes straight into $OUT (<stage>.log, session.json, session.rows.jsonl, tests-failures.txt, <stage>.tgz
# refreshed every 20 s). Unpack here with
#   d=bench/results/<gpu-slug>/<date>-<commit>; mkdir -p $d && tar xzf <stage>.tgz -C $d
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
STAGE="${1:-window}"
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
LOG="$OUT/$STAGE.log"
TMP="$(mktemp -d)"
export PYTHONUNBUFFERED=1
export FASTRL_INSTAFAIL=1  # tests/conftest.py: a failure's traceback printed as it happens (a cut call keeps it)
INSTALL_S=30
PACK_S=15
TESTS_KERNELS_S="${TESTS_KERNELS_S:-120}"
TESTS_REST_S="${TESTS_REST_S:-45}"
case "$STAGE" in
    rest)
        if ! [[ "${2:-}" =~ ^[0-9]+$ ]]; then
            echo "usage: bash bench/gpu_session.sh rest SECONDS [SECTIONS]: SECONDS, the device seconds left in the" \
                "window, is required (got '${2:-}')"
            exit 2
        fi
        CALL_LIMIT=$(($2 - 20))
        [ "$CALL_LIMIT" -gt 570 ] && CALL_LIMIT=570 ;;
    *) CALL_LIMIT="${CALL_LIMIT:-570}" ;;
esac
left() { echo $((CALL_LIMIT - (SECONDS - T0))); }
exec > >(tee -a "$LOG") 2>&1  # everything to the log and to the caller

SESSION_S=$((CALL_LIMIT - INSTALL_S - PACK_S))  # the plan of this call, before anything runs
case "$STAGE" in
    window) echo "plan ($CALL_LIMIT s): install ~${INSTALL_S} s; GPU kernel tests (tests/test_cuda_sm90.py," \
            "tests/test_cuda_kernels.py) <= ${TESTS_KERNELS_S} s; tests/test_cuda.py and the rest of the suite" \
            "<= ${TESTS_REST_S} s; python -m bench session ~$((SESSION_S - TESTS_KERNELS_S - TESTS_REST_S)) s (what" \
            "is left); pack ${PACK_S} s" ;;
    rest) echo "plan ($CALL_LIMIT s of the $2 s left): install ~${INSTALL_S} s; python -m bench session --sections" \
            "${3:-configs,compile} ~${SESSION_S} s; the suite in what is left over a minute; pack ${PACK_S} s" ;;
    *) echo "plan ($CALL_LIMIT s): $STAGE" ;;
esac
[ -n "${PLAN_ONLY:-}" ] && exit 0  # tests/test_gpu_window.py checks the plan's arithmetic

pack() {  # every file of this call into <stage>.tgz, replaced whole (a cut leaves the last complete archive)
    (cd "$OUT" && tar czf ".$STAGE.tgz.part" --exclude "*.tgz" --exclude ".*" -- * 2>/dev/null &&
        mv -f ".$STAGE.tgz.part" "$STAGE.tgz")
}
( while sleep 20; do pack; done ) &
PACKER=$!
trap 'kill $PACKER 2>/dev/null' EXIT

install() {
    # the wheels are for the GPU image's Python 3.12; elsewhere (a CPU smoke run) the installed packages serve
    if compgen -G ".whl/*.whl" >/dev/null && python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/site
    fi
    # fastrl.kernels is the kernels/ folder: an editable install maps it (no build isolation: no network)
    python3 -c "import fastrl.kernels" 2>/dev/null ||
        python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null || true
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
    echo "install: done at $((SECONDS - T0)) s"
}

tests() {  # tests() LIMIT WHAT FILES...: pytest -v (no xdist), each verdict in the log as it finishes
    local limit=$1 what=$2
    shift 2
    [ "$limit" -gt "$(($(left) - PACK_S))" ] && limit=$(($(left) - PACK_S))
    if [ "$limit" -lt 20 ]; then
        echo "tests ($what): not run (${limit} s for it: its bound, or what is left of the call less the packing)"
        return 0
    fi
    echo "tests ($what): python -m pytest -v, at most ${limit} s"
    timeout --foreground "$limit" python3 -m pytest -v -p no:cacheprovider -rfE "$@" 2>&1 | tee -a "$TMP/tests.out"
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 124 ] && echo "tests ($what): stopped at its limit (${limit} s)"
    grep -E "(FAILED|ERROR)( |$)" "$TMP/tests.out" | grep -v "^=" | sort -u >"$OUT/tests-failures.txt"
    echo "tests ($what): exit $rc; so far $(grep -c " PASSED" "$TMP/tests.out") passed," \
        "$(wc -l <"$OUT/tests-failures.txt") failed (tests-failures.txt)"
}

GPU_TESTS=(tests/test_cuda_sm90.py tests/test_cuda_kernels.py tests/test_cuda.py tests/test_invariance.py)
cuda_then_rest() {  # cuda_then_rest LIMIT FILES...: those GPU test files, then the suite without GPU_TESTS, in LIMIT s
    # (two pytest runs: given a file and its folder, pytest collects in the folder's order, not the file first)
    local end=$((SECONDS + $1))
    shift
    tests "$((end - SECONDS))" "$*" "$@"
    tests "$((end - SECONDS))" "the rest of the suite" tests "${GPU_TESTS[@]/#/--ignore=}"
}

session() {  # session NAME [ARGS...]: python -m bench session in what is left of the call less the packing
    local name=$1 budget=$(($(left) - PACK_S - 10))
    shift
    if [ "$budget" -lt 30 ]; then
        echo "session: not run (${budget} s left of the call)"
        return 0
    fi
    echo "session: python -m bench session --budget $budget $*"
    timeout --foreground $((budget + 5)) python3 -m bench session --budget "$budget" --out "$OUT" --name "$name" "$@" ||
        rc=1
}

# every `timeout` below runs in the foreground: in this script's process group, so a cut of the call (the group
# killed) reaches the session, which takes its measuring processes with it
rc=0
case "$STAGE" in
    window)
        install
        tests "$TESTS_KERNELS_S" "GPU kernels" tests/test_cuda_sm90.py tests/test_cuda_kernels.py
        cuda_then_rest "$TESTS_REST_S" tests/test_cuda.py tests/test_invariance.py
        session session ;;
    rest)
        install
        session session-rest --sections "${3:-configs,compile}"
        [ "$(left)" -gt 60 ] && cuda_then_rest $(($(left) - PACK_S)) tests/test_cuda_sm90.py \
            tests/test_cuda_kernels.py tests/test_cuda.py tests/test_invariance.py ;;
    w5)
        install
        timeout --foreground $(($(left) - 20)) python3 -m bench w5 --no-plots --out "$OUT" --workload 0.5B \
            --budget-mb 24576 --providers trl,fastrl,fastrl+both || rc=1 ;;
    smoke) session session --smoke ;;
    *) echo "unknown stage $STAGE (window, rest SECONDS [SECTIONS], w5, smoke)"; exit 2 ;;
esac
kill $PACKER 2>/dev/null
pack && echo "results: $OUT/$STAGE.tgz ($(cd "$OUT" && ls | tr '\n' ' '))"
exit $rc
