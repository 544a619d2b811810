#!/usr/bin/env bash
# Check this repository against another torch release (e.g. the oldest one pyproject allows).
#
#   scripts/check_torch_version.sh 2.10 [extra pytest args, e.g. -k "not slow"]
#
# 1. makes (or reuses) a scratch venv and installs torch==X.Y.* from the package registry (its
#    Linux wheels are CUDA builds with their nvidia-* dependencies; they run on the CPU here);
# 2. copies the working tree (tracked + untracked-not-ignored files) into the venv folder and runs
#    `pip install -e ".[dev]"` from the copy, then checks that this did NOT replace the torch
#    installed in step 1 (a user with torch_npu pinned to that torch must keep it);
# 3. runs the unit and multi-process tests (tests/, gloo) with that torch.
#
# Environment (defaults in brackets):
#   VENV_DIR    scratch venv                                 [/tmp/engram-torch-X.Y]
#   PYTHON      interpreter for the venv                     [python3]
#   WHEEL_DIR   extra --find-links folder (pre-downloaded wheels), optional
# Exit status: 0 when torch was kept and every test passed; the pytest summary is the record.
set -euo pipefail

if [[ $# -lt 1 || ! "$1" =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?$ ]]; then
    echo "usage: scripts/check_torch_version.sh X.Y[.Z] [pytest args...]   (e.g. 2.10)" >&2
    exit 2
fi
VERSION="$1"
shift
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_DIR="${VENV_DIR:-/tmp/engram-torch-$VERSION}"
PYTHON="${PYTHON:-python3}"
PIP_EXTRA=()
if [[ -n "${WHEEL_DIR:-}" ]]; then PIP_EXTRA+=(--find-links "$WHEEL_DIR"); fi
# X.Y means the newest X.Y.*; X.Y.Z is exact.
if [[ "$VERSION" =~ ^[0-9]+\.[0-9]+$ ]]; then SPEC="torch==$VERSION.*"; else SPEC="torch==$VERSION"; fi

echo "== $(date -u '+%Y-%m-%d %H:%M UTC') torch $SPEC in $VENV_DIR (free disk: $(df -h --output=avail "$(dirname "$VENV_DIR")" | tail -1 | tr -d ' '))"
if [[ ! -x "$VENV_DIR/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV_DIR"
fi
PY="$VENV_DIR/bin/python"
"$PY" -m pip install -q --upgrade pip >/dev/null
"$PY" -m pip install -q "${PIP_EXTRA[@]}" "$SPEC"
torch_version() { TORCH_DEVICE_BACKEND_AUTOLOAD=0 "$PY" -c "import torch; print(torch.__version__)"; }
BEFORE="$(torch_version)"
echo "== installed torch $BEFORE"

# A copy of the working tree, so the editable install's build files stay out of the checkout.
SRC="$VENV_DIR/src"
rm -rf "$SRC"
mkdir -p "$SRC"
(cd "$ROOT" && git ls-files -z -co --exclude-standard | xargs -0 tar -cf - --no-recursion) | tar -xf - -C "$SRC"
(cd "$SRC" && "$PY" -m pip install -q "${PIP_EXTRA[@]}" -e ".[dev]")
AFTER="$(torch_version)"
if [[ "$AFTER" != "$BEFORE" ]]; then
    echo "FAIL: pip install -e . replaced torch $BEFORE with $AFTER: the torch range in pyproject.toml excludes $BEFORE" >&2
    exit 1
fi
echo "== pip install -e . kept torch $AFTER"

cd "$SRC"
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
# Tests that launch torchrun / python subprocesses must get this venv's torch, not the system one.
export PATH="$VENV_DIR/bin:$PATH"
unset PYTHONPATH
echo "== pytest with torch $AFTER"
"$PY" -m pytest -q -p no:cacheprovider tests "$@"
echo "== PASS: torch $AFTER ($(date -u '+%Y-%m-%d %H:%M UTC'))"
