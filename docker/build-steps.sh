#!/usr/bin/env bash
# The pip steps of the top-level Dockerfile, run outside Docker: proves the image build works and
# leaves the runtime environment in a fresh venv.
#
#   docker/build-steps.sh VENV_DIR
#
# Afterwards VENV_DIR/bin/statestore-async is the daemon's CLI and VENV_DIR's Python imports
# statestore_async._native (the compiled modules) from the installed wheel.
#
# Each `pip ...` line below appears verbatim in the Dockerfile (tests/test_image_steps.py checks
# it): change both together. Like the Dockerfile, it builds from a copy of exactly the files the
# Dockerfile COPYs, so it never writes into the source tree. pip's cache is used unless
# PIP_NO_CACHE_DIR is set (the Dockerfile sets it). PYTHON picks the interpreter (python3.11 in
# the image).
set -euo pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 VENV_DIR" >&2
    exit 2
fi
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$(mkdir -p "$1" && cd "$1" && pwd)
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/statestore-image-steps.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
export WHEELS="$WORK/wheels"

# --- stage "builder" -------------------------------------------------------------------------
# COPY requirements/ pyproject.toml setup.py README.md _ext/ statestore_async/ (the Dockerfile's COPYs)
mkdir -p "$WORK/src"
cp -R "$SRC/requirements" "$SRC/pyproject.toml" "$SRC/setup.py" "$SRC/README.md" "$SRC/_ext" "$SRC/statestore_async" "$WORK/src/"
# Build products of an in-place build in the source tree are not sources.
find "$WORK/src" \( -name '__pycache__' -o -name '*.so' \) -prune -exec rm -rf {} +

"$PYTHON" -m venv "$WORK/builder"
export PATH="$WORK/builder/bin:$PATH"
cd "$WORK/src"
pip install -r requirements/build.txt
pip wheel --wheel-dir "$WHEELS" -r requirements/runtime.txt
pip wheel --no-deps --no-build-isolation --wheel-dir "$WHEELS" .

# --- final stage -----------------------------------------------------------------------------
"$PYTHON" -m venv "$VENV"
export PATH="$VENV/bin:$PATH"
pip install --no-index --find-links "$WHEELS" -r requirements/runtime.txt statestore-async
echo "runtime venv ready: $VENV"
