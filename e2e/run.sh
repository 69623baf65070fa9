#!/usr/bin/env bash
# `make e2e`: the end-to-end suite against real vLLM (CPU) instances, through `epd-proxy serve`.
#  1. e2e/setup_vllm.sh creates or reuses the vLLM environment and the tiny models, in
#     ${EPD_E2E_CACHE:-$HOME/.cache/epd-proxy-e2e} (outside the repository);
#  2. pytest runs the tests marked `vllm` under tests/e2e; their fixtures start the vLLM
#     instances and the proxy on loopback and stop every process they started, by PID.
# Exit code: pytest's, except that "no tests collected" (5) is an error too.
# Extra arguments go to pytest, e.g. `bash e2e/run.sh -k pd_nixl -x`.
set -uo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(dirname "$HERE")
cd "$REPO"
PY=${PY:-$REPO/.venv/bin/python}

export EPD_E2E_CACHE=${EPD_E2E_CACHE:-$HOME/.cache/epd-proxy-e2e}
# In this script a missing environment or a proxy that cannot start fails the run; set
# EPD_E2E_REQUIRE_PROXY=0 to skip the proxy tests (e.g. to check the vLLM setup alone).
export EPD_E2E_REQUIRE_VLLM=1
export EPD_E2E_REQUIRE_PROXY=${EPD_E2E_REQUIRE_PROXY:-1}

t0=$(date +%s)
bash "$HERE/setup_vllm.sh" || { echo "e2e: setup_vllm.sh failed" >&2; exit 1; }
t1=$(date +%s)

KEEP_LOGS=${EPD_E2E_LOG_DIR:+1}
export EPD_E2E_LOG_DIR=${EPD_E2E_LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/epd-e2e-logs.XXXXXX")}
echo "e2e: setup took $((t1 - t0))s; vLLM and proxy logs in $EPD_E2E_LOG_DIR" >&2

# pytest in the background so that a TERM/INT sent to this script reaches it (its fixtures then
# stop the vLLM processes); it is the only child this script starts.
"$PY" -m pytest -m vllm tests/e2e -p no:cacheprovider -q -rfEs "$@" &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null' TERM INT
wait "$pid"; rc=$?
# `wait` returns early (>128) when a trapped signal arrives: wait for pytest's own exit code.
while kill -0 "$pid" 2>/dev/null; do wait "$pid"; rc=$?; done
trap - TERM INT

echo "e2e: pytest exited $rc after $(( $(date +%s) - t1 ))s (total $(( $(date +%s) - t0 ))s)" >&2
if [ "$rc" -eq 0 ] && [ -z "$KEEP_LOGS" ]; then
    rm -rf "$EPD_E2E_LOG_DIR"   # kept on failure (and when EPD_E2E_LOG_DIR was given)
fi
if [ "$rc" -eq 5 ]; then
    echo "e2e: no tests were collected: that is a failure here" >&2
    exit 1
fi
exit "$rc"
