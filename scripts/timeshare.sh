#!/usr/bin/env bash
# Time-share one port between two snapshots: switch N times, print each switch time.
#   scripts/timeshare.sh SNAPSHOT_A SNAPSHOT_B [PORT] [N]
# A target may also be a model with its engine args, as `vllm-snapshot serve` takes them:
#   scripts/timeshare.sh "model=/srv/m1 --max-model-len 512" "model=/srv/m2 --dtype float32" 8000 6
# (the snapshot of that key is used, built first -- while the other engine serves -- if none is valid).
# Each switch restores the other snapshot while whatever serves on PORT keeps serving (oracle
# checked before it gets the port), hands it the port's listening socket and then stops the old
# engine (or, when both do not fit in memory, stops the old engine first and restores after),
# then sends one completion. Prints one line per switch with two times -- the switch command as
# a whole (finding the snapshot: a model target's key computation hashes the model; validation)
# and the part of it where PORT is not served (0 after a hand-over: the port never stops
# listening; else the stop and the restore) -- and a summary of each
# (median, min, max seconds); stops the last engine at the end. Needs root and the venv from
# scripts/setup.sh.
set -euo pipefail
A=${1:?usage: timeshare.sh SNAPSHOT_A SNAPSHOT_B [PORT] [N]}
B=${2:?usage: timeshare.sh SNAPSHOT_A SNAPSHOT_B [PORT] [N]}
PORT=${3:-8000}
N=${4:-6}
VS=${VLLM_SNAPSHOT:-${VLLM_SNAPSHOT_CACHE:-/var/cache/vllm-snapshot}/venv/bin/vllm-snapshot}
PY=$(dirname "$VS")/python
times=()
walls=()
trap '"$VS" stop --port "$PORT" >/dev/null 2>&1 || true' EXIT
for i in $(seq 1 "$N"); do
  if (( i % 2 )); then snap=$A; else snap=$B; fi
  t0=$EPOCHREALTIME
  if [[ $snap == model=* ]]; then
    read -r -a spec <<<"${snap#model=}"
    out=$("$VS" switch --model "${spec[0]}" --port "$PORT" --json -q -- "${spec[@]:1}")
  else
    out=$("$VS" switch "$snap" --port "$PORT" --json -q)
  fi
  wall=$("$PY" -c "print(f'{$EPOCHREALTIME - $t0:.3f}')")
  s=$(printf '%s' "$out" | "$PY" -c 'import json,sys; d = json.load(sys.stdin); print(0.0 if d.get("handover") else d["switch_s"])')
  used=$(printf '%s' "$out" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["serving"]["snapshot"])')
  model=$("$VS" inspect "$used" --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["manifest"]["model"]["served_name"])')
  curl -fsS "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
       -d "{\"model\":\"$model\",\"prompt\":\"Hello\",\"max_tokens\":1}" >/dev/null
  printf 'switch %d -> %s: %s s (port not served: %s s)\n' "$i" "$snap" "$wall" "$s"
  times+=("$s")
  walls+=("$wall")
done
summary() {  # $1 = what; the numbers on stdin
  "$PY" -c '
import statistics, sys
t = [float(x) for x in sys.stdin.read().split()]
print(f"{len(t)} switches, {sys.argv[1]}: median {statistics.median(t):.2f} s, min {min(t):.2f} s, max {max(t):.2f} s")' "$1"
}
printf '%s\n' "${walls[@]}" | summary "whole switch command"
printf '%s\n' "${times[@]}" | summary "port not served"
