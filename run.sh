#!/usr/bin/env bash
# The two set-up-and-go commands of README.md:
#   ./run.sh bench [ARGS]  - create/reuse .venv, run the side-by-side benchmark against torch
#   ./run.sh test  [ARGS]  - create/reuse .venv, install the test extra, run ruff, mypy and pytest
# The virtual environment lives in .venv (override with SHMLOADER_VENV); it is (re)installed when
# setup.cfg, setup.py, the C extension or this script changes (the install compiles
# arena/_stream.c). torch is pinned here (CPU build) so a fresh machine does not pull a multi-GB
# CUDA wheel; setup.cfg keeps a range for real users.
set -euo pipefail
cd "$(dirname "$0")"

TORCH_PIN="${SHMLOADER_TORCH:-torch==2.13.0}"
VENV="${SHMLOADER_VENV:-.venv}"
PY="${PYTHON:-python3}"

ensure_venv() {
  local extras="$1"
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
  fi
  local stamp="$VENV/.shmloader-installed-$extras"
  local want
  want="$(cat setup.cfg setup.py arena/_stream.c run.sh | sha256sum | cut -d' ' -f1) $TORCH_PIN"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    "$VENV/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
    "$VENV/bin/python" -m pip install --quiet "$TORCH_PIN"
    "$VENV/bin/python" -m pip install --quiet -e ".[$extras]"
    echo "$want" > "$stamp"
  fi
}

cmd="${1:-}"
shift || true
case "$cmd" in
  bench)
    ensure_venv tools
    exec "$VENV/bin/python" -m tools.bench "$@"
    ;;
  test)
    ensure_venv test
    echo "== ruff"
    "$VENV/bin/python" -m ruff check arena shmloader tools tests
    echo "== mypy"
    "$VENV/bin/python" -m mypy arena shmloader
    echo "== pytest"
    # As root, the suite runs with a private /dev/shm (a fresh tmpfs in its own mount namespace),
    # so its leak guard sees only what the tests made, even beside other jobs on the machine.
    # SHMLOADER_PRIVATE_SHM=0 turns this off.
    if [ "${SHMLOADER_PRIVATE_SHM:-1}" = 1 ] && [ "$(id -u)" = 0 ] && unshare -m true 2>/dev/null; then
      exec unshare -m sh -c 'mount -t tmpfs -o size=50% tmpfs /dev/shm && exec "$@"' sh \
        "$VENV/bin/python" -m pytest "$@"
    fi
    exec "$VENV/bin/python" -m pytest "$@"
    ;;
  *)
    echo "usage: ./run.sh bench [ARGS] | ./run.sh test [PYTEST ARGS]" >&2
    exit 2
    ;;
esac
