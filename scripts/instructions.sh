#!/usr/bin/env bash
# Instructions the proxy process executes per request (user space), counted by valgrind's
# callgrind: a figure that, unlike CPU time, does not move with the machine's speed or with
# other load, so two versions of the proxy can be compared on a busy machine. Kernel work
# (system calls) is not in it: the comparison benchmark (docs/benchmarks.md) measures CPU.
#
#   scripts/instructions.sh SRC MODE N [serve flags...]
#     SRC   the package's source folder to run the proxy from (e.g. src, or another checkout's)
#     MODE  stream | nonstream (chat) | messages | responses (the same prompt, streamed)
#     N     measured requests (after 200 unmeasured ones), over 4 keep-alive connections
#
# P/D on one simulated prefill and one decode (from this checkout, no delays), the proxy under
# callgrind with instrumentation switched on only around the measured requests.
# Needs valgrind (apt-get install valgrind).
set -euo pipefail
SRC=$(cd "$1" && pwd); MODE=$2; N=$3; shift 3
HERE=$(cd "$(dirname "$0")" && pwd); REPO=$(dirname "$HERE")
PY=${PY:-$REPO/.venv/bin/python}
OUT=$(mktemp -d "${TMPDIR:-/tmp}/epd-instructions.XXXXXX")
port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
SP=$(port); PP=$(port)  # the simulator takes SP and SP + 1
# ITL_MS: the simulated decode's time between tokens (0: events arrive together, as fast as the
# proxy reads; a few ms: one event per read, as at moderate load). EPD_TOKENS: tokens per answer.
# KV_EVENTS=1: the simulated instances publish vLLM's KV cache events and the proxy subscribes
# (each request then pays its /tokenize call and the block index lookup).
EVENTS=()
[ "${KV_EVENTS:-0}" = 1 ] && EVENTS=(--set kv_events=true)
PYTHONPATH=$REPO/src "$PY" -m epd_proxy sim --prefill 1 --decode 1 --ttft-ms 0 --itl-ms "${ITL_MS:-0}" --no-records \
    --base-port "$SP" "${EVENTS[@]}" > "$OUT/sim.log" 2>&1 &
SIM=$!
# The simulated instances answer before the proxy starts: a proxy whose first probe found them
# closed would answer the first requests 503 (no instance accepts connections).
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$SP/health" > /dev/null && curl -sf "http://127.0.0.1:$((SP + 1))/health" > /dev/null && break
    sleep 0.1
done
P="http://127.0.0.1:$SP"; D="http://127.0.0.1:$((SP + 1))"
if [ "${KV_EVENTS:-0}" = 1 ]; then
    for _ in $(seq 100); do grep -q "^kv events: decode" "$OUT/sim.log" && break; sleep 0.1; done
    P=$(awk '/^kv events: prefill/ {print $4 ";kv_events=" $5 ";kv_events_replay=" $6}' "$OUT/sim.log")
    D=$(awk '/^kv events: decode/ {print $4 ";kv_events=" $5 ";kv_events_replay=" $6}' "$OUT/sim.log")
fi
PYTHONPATH=$SRC valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$OUT/callgrind.%p" \
    "$PY" -m epd_proxy serve --host 127.0.0.1 --port "$PP" --prefill "$P" \
    --decode "$D" --log-level warning "$@" > "$OUT/proxy.log" 2>&1 &
PROXY=$!
trap 'kill $PROXY $SIM 2>/dev/null || true' EXIT
for _ in $(seq 600); do curl -sf "http://127.0.0.1:$PP/ready" > /dev/null && break; sleep 0.5; done
# /ready says the proxy takes traffic; a request is answered 503 ("not ready") until both roles'
# first probes have said which models they serve, which under callgrind can come later: wait for
# one answered request before the counted ones.
for _ in $(seq 240); do
    curl -sf -H 'Content-Type: application/json' "http://127.0.0.1:$PP/v1/chat/completions" \
        -d '{"model":"sim-model","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}' > /dev/null && break
    sleep 0.5
done
"$PY" "$HERE/instructions_driver.py" "$PP" 200 4 "$MODE"
callgrind_control -i on "$PROXY" > /dev/null
"$PY" "$HERE/instructions_driver.py" "$PP" "$N" 4 "$MODE"
callgrind_control -i off "$PROXY" > /dev/null
callgrind_control -d "$PROXY" > /dev/null
kill "$PROXY" "$SIM"; wait "$PROXY" "$SIM" 2>/dev/null || true
trap - EXIT
IR=$(grep -h "^summary:\|^totals:" "$OUT"/callgrind.* | awk '{s += $2} END {printf "%.0f\n", s}')
echo "$MODE: $((IR / N)) instructions per request ($N requests; callgrind files in $OUT)"
