#!/usr/bin/env bash
# Prove the CUDA checkpoint mechanics on a lent GPU machine, with OUR cuda-checkpoint
# (python -m vllm_snapshot.cuda_checkpoint) and, when carried, a real CRIU + CUDA plugin run the
# way vllm-snapshot runs it.
#
# Target machine (design notes, "GPU hosts"): one H200, driver 580, CUDA 13, torch cu130 and
# cuda-bindings installed; no network, no criu, no vLLM; runs as root in the repo root; what is
# written under $OUT comes back. Device time is scarce (15 min per task, machine start
# included): the whole script keeps to GPU_CHECK_BUDGET_S (default 300 s, so a failed run can
# be run once more), every command runs under `timeout`.
#
#   part A (always): a torch CUDA worker allocates a deterministic tensor (GPU_CHECK_MIB MiB,
#     default 256) and prints its checksum when sent SIGUSR1. Then, via our helper, each call
#     timed (one run = one driver attach; CRIU's freeze timeout is sized from it):
#     get-restore-tid of a non-CUDA PID (must fail, exit 1) -> get-state running ->
#     get-restore-tid -> lock --timeout 10000 -> checkpoint (GPU memory released per nvidia-smi,
#     no /dev/nvidia* fds left) -> restore (memory back) -> unlock -> same checksum.
#   CRIU prerequisites (parts C and B need .criu-carry/, made by scripts/gpu_carry.sh and carried
#     with carry=[".criu-carry"]): the carried criu runs, and `criu check` passes -- else they
#     are NOT RUN with the first reason `criu check` gives (e.g. a gVisor-like kernel).
#   part C (the product's invocation, scripts/gpu_check_tree.py): pycriu `criu swrk` with the
#     plugin directory in CRIU_LIBS_DIR and our wrapper first on PATH (as vllm_snapshot.criu
#     passes them), the product's flags, freeze timeout, network lock and mount policy; a tree in
#     its own PID + mount + network namespace whose root has no CUDA and whose child does; sleep-like free of the
#     child's device memory before the dump, restore-sibling, the product's log and
#     --get-state checks, then a wake-like re-allocation and the same deterministic output.
#   part B (the CLI, for contrast): a fresh worker dumped with `criu dump -L <plugin dir>`, our
#     helper first on PATH, `criu restore --restore-detached`; same checksum, GPU memory back.
#
# Usage:  bash scripts/gpu_check.sh     (env: OUT, PYTHON, GPU_CHECK_MIB, GPU_CHECK_BUDGET_S)
# Exit:   0 all checks passed; 1 some check failed; 3 NOT RUN: a precondition is missing (no GPU,
#         gVisor kernel, no torch/cuda-bindings, not root) or CRIU cannot run here (part A may
#         have passed: see the summary). Summary on stdout and in $OUT/gpu_check.log.
# `[ test ] && result PASS ... || result FAIL ...` is safe here: result() always returns 0.
# shellcheck disable=SC2015
set -uo pipefail

START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-300}
DEADLINE=$((START + BUDGET))
MIB=${GPU_CHECK_MIB:-256}
PY=${PYTHON:-python3}
REPO=$(cd "$(dirname "$0")/.." && pwd)
CARRY=$REPO/.criu-carry
if [ -z "${OUT:-}" ]; then OUT=$(mktemp -d /tmp/gpu-check-out.XXXXXX); fi
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
: >"$LOG"
WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)
RESULTS=()
PIDS_TO_KILL=()
cd "$REPO" || exit 3

log() { printf '%s [%4ss] %s\n' "$(date +%H:%M:%S)" "$(($(date +%s) - START))" "$*" | tee -a "$LOG"; }
result() { # result PASS|FAIL|SKIP|NOTRUN name detail...
  local st=$1 name=$2; shift 2
  RESULTS+=("$st  $name${*:+: $*}")
  log "$st $name${*:+: $*}"
  return 0
}
remaining() { echo $((DEADLINE - $(date +%s))); }
# tmo SECONDS cmd...: run under timeout, capped by what is left of the budget (exit 124 = timed out)
tmo() {
  local want=$1 left; shift
  left=$(($(remaining) - 10))
  if [ "$left" -le 0 ]; then log "budget exhausted before: $*"; return 124; fi
  [ "$want" -gt "$left" ] && want=$left
  timeout -k 5 "$want" "$@"
}
ms_now() { date +%s%3N; }

cleanup() {
  local p
  for p in "${PIDS_TO_KILL[@]+"${PIDS_TO_KILL[@]}"}"; do
    [ -n "$p" ] && kill -0 "$p" 2>/dev/null && kill -KILL "$p" 2>/dev/null
  done
  rm -rf "$WORK"
}

summary_and_exit() {
  local code=$1 r fails=0 notrun=0
  for r in "${RESULTS[@]+"${RESULTS[@]}"}"; do
    case "$r" in FAIL*) fails=$((fails + 1)) ;; NOTRUN*) notrun=$((notrun + 1)) ;; esac
  done
  [ "$code" -eq 0 ] && [ "$notrun" -gt 0 ] && code=3
  [ "$code" -ne 1 ] && [ "$fails" -gt 0 ] && code=1
  {
    echo "================ gpu_check summary ($(($(date +%s) - START)) s of $BUDGET s) ================"
    for r in "${RESULTS[@]+"${RESULTS[@]}"}"; do echo "$r"; done
    case $code in
      0) echo "GPU_CHECK: PASS" ;;
      3) echo "GPU_CHECK: NOT RUN (precondition missing or CRIU cannot run here, see above)" ;;
      *) echo "GPU_CHECK: FAIL ($fails failed)" ;;
    esac
  } | tee -a "$LOG"
  cleanup
  trap - EXIT
  exit "$code"
}
trap 'log "interrupted"; summary_and_exit 1' INT TERM
trap 'summary_and_exit 1' EXIT

precondition() { result NOTRUN precondition "$*"; summary_and_exit 3; }

# ---------------------------------------------------------------- preconditions ---------------
log "gpu_check in $REPO, OUT=$OUT, work=$WORK, tensor ${MIB} MiB, budget ${BUDGET} s"
# gVisor (runsc) reports kernel 4.4.0 and says so in its dmesg; neither CRIU (ptrace, parasite
# code) nor the checkpoint ioctls can work there, so nothing here could pass or fail meaningfully.
kver=$(uname -r 2>/dev/null)
if [ "$kver" = "4.4.0" ] || { dmesg 2>/dev/null | head -n 5 | grep -qi gvisor; }; then
  precondition "gVisor kernel (uname -r = $kver): CRIU and the CUDA checkpoint ioctls cannot run in this sandbox"
fi
if ! command -v nvidia-smi >/dev/null 2>&1; then
  precondition "no GPU: nvidia-smi is not installed on this host"
fi
if ! smi_l=$(timeout 30 nvidia-smi -L 2>&1) || ! grep -q '^GPU ' <<<"$smi_l"; then
  precondition "no GPU: \`nvidia-smi -L\` lists none: $(head -c 300 <<<"$smi_l")"
fi
log "GPUs: $smi_l"
[ "$(id -u)" -eq 0 ] || precondition "must run as root (cuda-checkpoint of another process and CRIU need it)"
if ! vers=$(timeout 120 "$PY" -W ignore -c '
import torch, cuda.bindings, platform
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "cuda-bindings", cuda.bindings.__version__, "cuda_available", torch.cuda.is_available())
' 2>&1); then
  precondition "$PY cannot import torch and cuda.bindings: $(tail -c 300 <<<"$vers")"
fi
log "$vers"
grep -q "cuda_available True" <<<"$vers" || precondition "no GPU: torch.cuda.is_available() is False"
{
  echo "## nvidia-smi"; timeout 30 nvidia-smi 2>&1
  echo "## persistence"; timeout 30 nvidia-smi -q 2>&1 | grep -i persistence
  echo "## kernel"; uname -a
  echo "## os"; head -n 2 /etc/os-release 2>/dev/null; ldd --version 2>&1 | head -n 1
  echo "## caps"; grep -i '^cap' /proc/self/status
  echo "## /proc/driver/nvidia/gpus"; ls /proc/driver/nvidia/gpus 2>&1
  echo "## python packages"; "$PY" -c 'import google.protobuf, psutil; print("protobuf", google.protobuf.__version__, "psutil", psutil.__version__)' 2>&1
} >"$OUT/environment.txt" 2>&1
log "environment written to $OUT/environment.txt"

HELPER=("$PY" -W ignore -m vllm_snapshot.cuda_checkpoint)
# helper ARGS...: stdout+stderr of the helper, its exit code; each run's wall time goes to the log
helper() {
  local t0 rc
  t0=$(ms_now)
  tmo 60 "${HELPER[@]}" "$@" </dev/null; rc=$?
  printf '%s helper %s -> exit %s in %s ms\n' "$(date +%H:%M:%S)" "$*" "$rc" "$(($(ms_now) - t0))" >>"$OUT/helper-timings.txt"
  return $rc
}

gpu_used_mib() { timeout 30 nvidia-smi -i 0 --query-gpu=memory.used --format=csv,noheader,nounits | head -n1 | tr -d ' '; }
nvidia_fds() { # number of /dev/nvidia* fds of PID $1
  local f n=0
  for f in /proc/"$1"/fd/*; do [[ $(readlink "$f" 2>/dev/null) == /dev/nvidia* ]] && n=$((n + 1)); done
  echo "$n"
}

# ---------------------------------------------------------------- the worker ------------------
cat >"$WORK/worker.py" <<'EOF'
"""GPU worker: deterministic int32 tensor on cuda:0; on SIGUSR1 append one line
`<tag> <seq> sum=<int64 sum on GPU> sha=<sha256 of the bytes, 16 hex>` to the output file."""
import ctypes, hashlib, os, signal, sys, time
os.closerange(3, 1 << 16)  # nothing of the harness's (sockets, pipes) for CRIU to trip over
try:
    os.setsid()  # own session: no tty or job control for CRIU to care about
except OSError:
    pass
import torch

out = open(sys.argv[1], "a", buffering=1)
n = int(sys.argv[2]) * 1024 * 1024 // 4
g = torch.Generator(device="cuda").manual_seed(20250101)
x = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, device="cuda", generator=g)
torch.cuda.synchronize()
pending = [0]
signal.signal(signal.SIGUSR1, lambda *_: pending.__setitem__(0, pending[0] + 1))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

def checksum():
    s = int(x.sum(dtype=torch.int64).item())  # a kernel launch on the restored context
    h = hashlib.sha256()
    for c in x.split(1 << 24):
        c = c.cpu()  # device-to-host copies of every byte
        h.update(ctypes.string_at(c.data_ptr(), c.numel() * c.element_size()))
    return f"sum={s} sha={h.hexdigest()[:16]}"

seq = 0
out.write(f"ready {seq} {checksum()} pid={os.getpid()} bytes={x.numel() * 4}\n")
while True:
    if pending[0]:
        pending[0] -= 1
        seq += 1
        out.write(f"answer {seq} {checksum()}\n")
    time.sleep(0.05)
EOF

# wait_line FILE PATTERN SECONDS: wait until FILE has a line matching PATTERN; print it
wait_line() {
  local f=$1 pat=$2 secs=$3 end line
  end=$(($(date +%s) + secs))
  [ "$end" -gt "$DEADLINE" ] && end=$DEADLINE
  while [ "$(date +%s)" -lt "$end" ]; do
    line=$(grep -E "$pat" "$f" 2>/dev/null | tail -n1)
    if [ -n "$line" ]; then echo "$line"; return 0; fi
    sleep 0.2
  done
  return 1
}
# ask PID FILE SEQ: SIGUSR1 and print the checksum part of answer SEQ
ask() {
  kill -USR1 "$1" 2>/dev/null || return 1
  wait_line "$2" "^answer $3 " 120 | awk '{print $3, $4}'
}
start_worker() { # start_worker NAME -> sets WPID, WOUT
  WOUT=$WORK/$1.out
  : >"$WOUT"
  "$PY" -W ignore "$WORK/worker.py" "$WOUT" "$MIB" </dev/null >"$WORK/$1.stdout" 2>&1 &
  WPID=$!
  PIDS_TO_KILL+=("$WPID")
  local ready
  if ! ready=$(wait_line "$WOUT" '^ready ' 180); then
    log "worker $1 not ready; its output:"; tail -n 20 "$WORK/$1.stdout" | tee -a "$LOG"
    return 1
  fi
  log "worker $1 pid $WPID: $ready"
  echo "$ready" | awk '{print $3, $4}' >"$WORK/$1.ref"
}

# ---------------------------------------------------------------- part A: our helper ----------
log "== part A: lock/checkpoint/restore/unlock with our cuda-checkpoint"
out=$(helper -h 2>&1); rc=$?
if [ $rc -eq 0 ] && grep -q -- '--action' <<<"$out"; then result PASS "helper -h"; else result FAIL "helper -h" "rc=$rc $out"; fi

partA() {
  local ref a st tid ms used_run used_ckpt used_rest fds_run fds_ckpt t0 out rc
  # what CRIU's plugin asks of every non-CUDA process (exit 1 = "no need to pause"), timed
  t0=$(ms_now); out=$(helper --get-restore-tid --pid $$ 2>&1); rc=$?; ms=$(($(ms_now) - t0))
  [ $rc -eq 1 ] && result PASS "A non-CUDA process: get-restore-tid exit 1" "${ms} ms (one driver attach)" \
    || result FAIL "A non-CUDA process: get-restore-tid" "exit $rc (1 expected; 3 = helper cannot reach the driver): $out"
  start_worker a || { result FAIL "A worker start" "see $OUT/a.stdout"; cp "$WORK/a.stdout" "$OUT/" 2>/dev/null; return; }
  ref=$(cat "$WORK/a.ref")
  a=$(ask "$WPID" "$WOUT" 1)
  [ "$a" = "$ref" ] && result PASS "A checksum stable while running" "$ref" || { result FAIL "A checksum while running" "'$a' vs '$ref'"; return; }

  st=$(helper --get-state --pid "$WPID" 2>&1)
  [ "$st" = "running" ] && result PASS "A get-state running" || { result FAIL "A get-state" "expected running, got '$st'"; return; }
  tid=$(helper --get-restore-tid --pid "$WPID" 2>&1)
  if [[ "$tid" =~ ^[0-9]+$ ]] && [ -d "/proc/$WPID/task/$tid" ]; then
    result PASS "A get-restore-tid" "tid $tid is a thread of $WPID"
    st=$(helper --get-state --pid "$tid" 2>&1)  # as cuda_plugin_pause_devices asks
    [ "$st" = "running" ] && result PASS "A get-state by restore tid" || result FAIL "A get-state by restore tid" "'$st'"
  else
    result FAIL "A get-restore-tid" "'$tid' (thread of $WPID? $(cd "/proc/$WPID/task" 2>/dev/null && echo *))"
  fi
  used_run=$(gpu_used_mib); fds_run=$(nvidia_fds "$WPID")

  t0=$(ms_now); out=$(helper --action lock --pid "$WPID" --timeout 10000 2>&1); rc=$?; ms=$(($(ms_now) - t0))
  [ $rc -eq 0 ] || { result FAIL "A lock" "rc=$rc $out"; return; }
  st=$(helper --get-state --pid "$WPID" 2>&1)
  [ "$st" = "locked" ] && result PASS "A lock" "${ms} ms, state locked" || result FAIL "A lock" "state '$st'"

  t0=$(ms_now); out=$(helper --action checkpoint --pid "$WPID" 2>&1); rc=$?; ms=$(($(ms_now) - t0))
  [ $rc -eq 0 ] || { result FAIL "A checkpoint" "rc=$rc $out"; helper --action unlock --pid "$WPID" >/dev/null 2>&1; return; }
  st=$(helper --get-state --pid "$WPID" 2>&1)
  [ "$st" = "checkpointed" ] && result PASS "A checkpoint" "${ms} ms, state checkpointed" || result FAIL "A checkpoint" "state '$st'"
  sleep 1
  used_ckpt=$(gpu_used_mib); fds_ckpt=$(nvidia_fds "$WPID")
  grep -c nvidia "/proc/$WPID/maps" >"$WORK/a.maps_ckpt" 2>/dev/null
  if [ $((used_run - used_ckpt)) -ge $((MIB * 9 / 10)) ]; then
    result PASS "A GPU memory released" "memory.used ${used_run} -> ${used_ckpt} MiB"
  else
    result FAIL "A GPU memory released" "memory.used ${used_run} -> ${used_ckpt} MiB (tensor ${MIB} MiB)"
  fi
  if [ "$fds_ckpt" -eq 0 ]; then
    result PASS "A no /dev/nvidia* fds when checkpointed" "$fds_run before, 0 after; nvidia maps now $(cat "$WORK/a.maps_ckpt")"
  else
    result FAIL "A no /dev/nvidia* fds when checkpointed" "$fds_run before, $fds_ckpt after (CRIU cannot dump those)"
    ls -l "/proc/$WPID/fd" >"$OUT/a.fds_checkpointed.txt" 2>&1
  fi

  t0=$(ms_now); out=$(helper --action restore --pid "$WPID" 2>&1); rc=$?; ms=$(($(ms_now) - t0))
  [ $rc -eq 0 ] || { result FAIL "A restore" "rc=$rc $out"; return; }
  st=$(helper --get-state --pid "$WPID" 2>&1)
  used_rest=$(gpu_used_mib)
  [ "$st" = "locked" ] && result PASS "A restore" "${ms} ms, state locked, memory.used ${used_rest} MiB" || result FAIL "A restore" "state '$st'"
  [ $((used_rest - used_ckpt)) -ge $((MIB * 9 / 10)) ] && result PASS "A GPU memory back" "${used_ckpt} -> ${used_rest} MiB" \
    || result FAIL "A GPU memory back" "${used_ckpt} -> ${used_rest} MiB"

  t0=$(ms_now); out=$(helper --action unlock --pid "$WPID" 2>&1); rc=$?; ms=$(($(ms_now) - t0))
  [ $rc -eq 0 ] || { result FAIL "A unlock" "rc=$rc $out"; return; }
  st=$(helper --get-state --pid "$WPID" 2>&1)
  [ "$st" = "running" ] && result PASS "A unlock" "${ms} ms, state running" || result FAIL "A unlock" "state '$st'"

  a=$(ask "$WPID" "$WOUT" 2)
  [ "$a" = "$ref" ] && result PASS "A same checksum after restore" "$a" || result FAIL "A checksum after restore" "'$a' vs '$ref'"

  out=$(helper --action checkpoint --pid "$WPID" 2>&1); rc=$?
  [ $rc -ne 0 ] && result PASS "A checkpoint while running is refused" "$(head -c 160 <<<"$out")" \
    || result FAIL "A checkpoint while running is refused" "rc=0"
  kill -TERM "$WPID" 2>/dev/null; wait "$WPID" 2>/dev/null
  cp "$WOUT" "$OUT/a.out" 2>/dev/null
}
partA

# ---------------------------------------------------------------- CRIU prerequisites ---------
CRIU_OK=0
criu_setup() {
  local libdir criu plugdir out rc f soname have first
  if [ ! -f "$CARRY/bin/criu" ]; then
    result SKIP "C/B criu dump/restore" "no .criu-carry/ (prepare with scripts/gpu_carry.sh, carry=[\".criu-carry\"])"
    return
  fi
  log "== CRIU prerequisites"
  cp "$CARRY/MANIFEST" "$OUT/criu-carry.MANIFEST" 2>/dev/null
  criu=$WORK/criu; cp "$CARRY/bin/criu" "$criu"; chmod 0755 "$criu"
  plugdir=$WORK/plugins; mkdir -p "$plugdir"; cp "$CARRY/plugins/cuda_plugin.so" "$plugdir/"
  libdir=$WORK/criu-lib; mkdir -p "$libdir"
  have=$(ldconfig -p 2>/dev/null)  # one read: `ldconfig -p | grep -q` can die of SIGPIPE under pipefail
  for f in "$CARRY"/lib/*; do
    soname=$(basename "$f")
    grep -q "^[[:space:]]*$soname " <<<"$have" || ln -s "$f" "$libdir/$soname"
  done
  log "carried libraries used (missing on this host): $(cd "$libdir" && echo *)"
  # prepended: the helper CRIU runs inherits it, and may need the image's own entries (libcuda)
  export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  CRIU_BIN=$criu PLUGDIR=$plugdir
  if ! out=$(tmo 30 "$criu" --version 2>&1); then
    result NOTRUN "C/B criu runs here" "$(tail -c 300 <<<"$out")"; return
  fi
  result PASS "C/B criu runs here" "$(tr '\n' ' ' <<<"$out")"
  tmo 60 "$criu" check >"$OUT/criu-check.txt" 2>&1; rc=$?
  if [ $rc -ne 0 ]; then  # stop at the first failed prerequisite, with its reason
    first=$(grep -a -m1 -E 'Error|error|fail' "$OUT/criu-check.txt" | head -c 300)
    result NOTRUN "C/B criu check" "exit $rc: ${first:-see criu-check.txt}"
    return
  fi
  result PASS "C/B criu check" "$(tail -n1 "$OUT/criu-check.txt" | head -c 120)"
  if ! HDIR=$("$PY" -c 'import sys; from vllm_snapshot.cuda_checkpoint import helper_dir; print(helper_dir(sys.argv[1]))' "$WORK/cache" 2>&1); then
    result FAIL "C/B helper_dir" "$HDIR"; return
  fi
  out=$(PATH="$HDIR:$PATH" tmo 60 cuda-checkpoint -h 2>&1) && grep -q -- --action <<<"$out" \
    && result PASS "C/B wrapper on PATH" "$HDIR/cuda-checkpoint" || { result FAIL "C/B wrapper on PATH" "$out"; return; }
  if [ ! -d /proc/driver/nvidia/gpus ]; then
    export CRIU_FAULT=138  # FI_PLUGIN_CUDA_FORCE_ENABLE: the plugin's GPU test needs this dir
    log "no /proc/driver/nvidia/gpus: forcing the CUDA plugin on (CRIU_FAULT=138); note: vllm-snapshot itself" \
        "(gpu.engine_device, doctor) would call this host a CPU host"
  fi
  CRIU_OK=1
}
criu_setup

# ---------------------------------------------------------------- part C: the product's way ----
partC() {
  local out rc
  [ "$CRIU_OK" -eq 1 ] || return
  if [ "$(remaining)" -lt 100 ]; then result SKIP "C product invocation" "budget: $(remaining) s left"; return; fi
  if ! command -v ip >/dev/null 2>&1; then  # CRIU saves/restores the tree's network namespace with it
    result NOTRUN "C product invocation" "no \`ip\` (iproute2): CRIU needs it for the engine's network namespace"
    return
  fi
  if ! out=$(PYTHONPATH="$CARRY/python${PYTHONPATH:+:$PYTHONPATH}" tmo 60 "$PY" -c 'import pycriu, psutil, google.protobuf' 2>&1); then
    result NOTRUN "C product invocation" "$PY lacks what part C needs (carried pycriu + protobuf + psutil): $(tail -c 200 <<<"$out")"
    return
  fi
  log "== part C: pycriu swrk, product env/flags/checks, PID+mount namespace, non-CUDA root + CUDA child"
  PYTHONPATH="$CARRY/python${PYTHONPATH:+:$PYTHONPATH}" tmo 200 "$PY" -W ignore "$REPO/scripts/gpu_check_tree.py" \
    --criu "$CRIU_BIN" --plugin-dir "$PLUGDIR" --out "$OUT" --mib "$MIB" >"$OUT/partC.txt" 2>&1; rc=$?
  grep '^RESULT ' "$OUT/partC.txt" | while read -r _ st rest; do
    printf '%s\n' "$st $rest"
  done >"$WORK/partC.results"
  while read -r st rest; do
    if [[ $rest == *": "* ]]; then result "$st" "${rest%%: *}" "${rest#*: }"; else result "$st" "$rest"; fi
  done <"$WORK/partC.results"
  [ $rc -eq 0 ] || result FAIL "C product invocation" "exit $rc (see $OUT/partC.txt)"
}
partC

# ---------------------------------------------------------------- part B: the criu CLI ---------
partB() {
  local ref a img pid_r used_run used_dump used_rest t0 ms rc st
  [ "$CRIU_OK" -eq 1 ] || return
  if [ "$(remaining)" -lt 60 ]; then result SKIP "B criu CLI" "budget: $(remaining) s left"; return; fi
  log "== part B: criu dump/restore (CLI, -L) with the CUDA plugin and our helper"
  local CRIU=("$CRIU_BIN") plugdir=$PLUGDIR hdir=$HDIR
  start_worker b || { result FAIL "B worker start"; cp "$WORK/b.stdout" "$OUT/" 2>/dev/null; return; }
  ref=$(cat "$WORK/b.ref")
  [ -f "$WORK/a.ref" ] && { [ "$ref" = "$(cat "$WORK/a.ref")" ] && log "worker b has worker a's checksum (deterministic)" || log "note: worker b checksum differs from a's"; }
  a=$(ask "$WPID" "$WOUT" 1)
  [ "$a" = "$ref" ] || { result FAIL "B checksum while running" "'$a' vs '$ref'"; return; }
  used_run=$(gpu_used_mib)
  img=$WORK/img; mkdir -p "$img"

  t0=$(ms_now)
  PATH="$hdir:$PATH" tmo 240 "${CRIU[@]}" dump -t "$WPID" -D "$img" -o dump.log -v4 -L "$plugdir"; rc=$?
  ms=$(($(ms_now) - t0))
  grep -a 'cuda_plugin' "$img/dump.log" >"$OUT/criu-dump.cuda_plugin.txt" 2>/dev/null
  tail -n 3000 "$img/dump.log" >"$OUT/criu-dump.log.tail" 2>/dev/null
  if [ $rc -ne 0 ]; then
    result FAIL "B criu dump" "exit $rc after ${ms} ms: $(grep -a -m3 'Error' "$img/dump.log" | tr '\n' ' ' | head -c 600)"
    return
  fi
  wait "$WPID" 2>/dev/null  # reap it, so its PID is free for the restore
  sleep 1; used_dump=$(gpu_used_mib)
  result PASS "B criu dump" "${ms} ms, images $(du -sh "$img" | cut -f1), memory.used ${used_run} -> ${used_dump} MiB"
  grep -aq 'cuda_plugin: Checkpointing CUDA devices' "$img/dump.log" \
    && result PASS "B plugin checkpointed the GPU state" || result FAIL "B plugin checkpointed the GPU state" "see $OUT/criu-dump.cuda_plugin.txt"

  t0=$(ms_now)
  PATH="$hdir:$PATH" tmo 240 "${CRIU[@]}" restore -D "$img" -o restore.log -v4 -L "$plugdir" \
    --restore-detached --pidfile "$WORK/restored.pid"; rc=$?
  ms=$(($(ms_now) - t0))
  grep -a 'cuda_plugin' "$img/restore.log" >"$OUT/criu-restore.cuda_plugin.txt" 2>/dev/null
  tail -n 3000 "$img/restore.log" >"$OUT/criu-restore.log.tail" 2>/dev/null
  if [ $rc -ne 0 ]; then
    result FAIL "B criu restore" "exit $rc after ${ms} ms: $(grep -a -m3 'Error' "$img/restore.log" | tr '\n' ' ' | head -c 600)"
    return
  fi
  pid_r=$(cat "$WORK/restored.pid" 2>/dev/null)
  PIDS_TO_KILL+=("$pid_r")
  used_rest=$(gpu_used_mib)
  result PASS "B criu restore" "${ms} ms, pid ${pid_r} (dumped ${WPID}), memory.used ${used_rest} MiB"
  st=$(helper --get-state --pid "$pid_r" 2>&1)
  [ "$st" = "running" ] && result PASS "B restored process is running" || result FAIL "B restored state" "'$st'"
  a=$(ask "$pid_r" "$WOUT" 2)
  [ "$a" = "$ref" ] && result PASS "B same checksum after criu restore" "$a" || result FAIL "B checksum after criu restore" "'$a' vs '$ref'"
  [ $((used_rest - used_dump)) -ge $((MIB * 9 / 10)) ] && result PASS "B GPU memory back" "${used_dump} -> ${used_rest} MiB" \
    || result FAIL "B GPU memory back" "${used_dump} -> ${used_rest} MiB"
  kill -TERM "$pid_r" 2>/dev/null
  cp "$WOUT" "$OUT/b.out" 2>/dev/null
}
partB

summary_and_exit 0
