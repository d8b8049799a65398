#!/usr/bin/env bash
# Prove the CUDA checkpoint path on a lent GPU machine: OUR cuda-checkpoint helper
# (python -m vllm_snapshot.checkpoint.cuda_checkpoint) against the driver, and CRIU + its CUDA plugin
# checkpointing and restoring a CUDA process tree through the product's own calls.
#
# How to run it (about 6 minutes of device time with the machine's start; the script itself
# keeps to GPU_CHECK_BUDGET_S, default 240 s, so a failed run can be run once more):
#   here:           bash scripts/gpu_carry.sh        (CRIU, plugin, libraries, pycriu, `ip`, wheels)
#   on the device:  bash scripts/gpu_check.sh        with carry=[".criu-carry"], timeout_s 360
# The verdict is the last line of stdout; $OUT holds two files: gpu_check.log (this output) and
# gpu_check.tgz (every other diagnostic: environment.txt, results.tsv, CRIU logs, part C's
# events, part D's output and engine logs; the device returns at most 8 files).
#
# Target machine: one H200, driver 580, python3.12 with torch cu130 and cuda-bindings; no
# network, no criu, no vLLM, no `ip`, no pydantic/blake3; root; the driver under a read-only
# /usr/local/nvidia found through LD_LIBRARY_PATH; what is written under $OUT comes back.
#
# In this order (part C first: the verdict rests on it):
#   carried prerequisites (.criu-carry/, made by scripts/gpu_carry.sh): CRIU runs and `criu
#     check` passes; `ip` runs (CRIU saves the engine's network namespace with it: the carried
#     one is exported as CR_IP_TOOL); the carried wheels (pydantic, blake3, ...) install with
#     `pip install --no-index --target` and the product's modules import; the engine user
#     exists (made as scripts/setup.sh makes it when missing). Any of these missing: NOT RUN.
#   part C (the product's invocation, scripts/gpu_check_tree.py): a tree in its own PID + mount
#     + network namespace, with the product's scrubbed environment, mount policy and privilege
#     drop to the engine user; a non-CUDA root and a CUDA child holding vLLM's level-2 sleep
#     state (VA reserved, physical memory unmapped and released: cuda.bindings.driver as
#     vLLM's cumem allocator); create's inventory, then LocalCheckpointTools.dump / restore_tree (pycriu
#     swrk, plugin, our helper, the product's checks); then wake re-maps at the same VA and the
#     output matches. Also reports what NVML descriptors (torch.cuda.device_count() with
#     PYTORCH_NVML_BASED_CUDA_CHECK=1, as vLLM) do to the inventory and to CRIU. The restore
#     takes the GPU remap path with the identity device map (the one GPU's UUID onto itself:
#     "C restore with the identity device map"); GPU_CHECK_REMAP=0 restores without a map.
#   part D (after C, when 90 s are left; else an INFO line): the product's own create and restore
#     instead of C's re-sequencing of their calls (scripts/gpu_check_ops.py): ops.create,
#     ops.restore (detached) and ops.stop_engines through local_tools(engine_argv=...) of
#     vllm_snapshot/dev/gpu_engine.py, an engine speaking the engine protocol: a non-CUDA root and
#     a CUDA child holding a VMM range (reserved, mapped, the model's weights.bin copied in;
#     released at sleep with the reservation kept; re-mapped at the same VA and reloaded at
#     wake -- from the weights file create wrote from that memory, held open by the child: --weights
#     file) whose oracle is a checksum computed on that GPU memory. So create's preconditions,
#     sleep rehearsal, inventory, GPU evidence, dump, pack and publish, and restore's
#     validation, CRIU restore, wake, oracle (matching: the wake's proof), bind, /health and HTTP
#     canary all run as for vLLM; then one more completion must give the recorded checksum.
#     Its FAIL fails the verdict; the verdict does not yet rest on it (part C can go once D
#     passed on a GPU). A budget that leaves D its time: GPU_CHECK_BUDGET_S=360 (timeout_s 480).
#   part E (after D, when 30 s are left; not with the fake driver): the weights file's GPU half
#     with the product's functions (scripts/gpu_check_weights.py, vllm_snapshot/engine/weights.py):
#     a model's parameters on the GPU written into a file through bounded host copies (what a GPU
#     create with --weights file does), emptied as a level-2 sleep leaves them, filled back from
#     the file into the same storages (what its wake does instead of reloading the model files);
#     same output, same data_ptrs, the GB/s of both. Its FAIL fails the verdict.
#   part A (after C, D and E, when 60 s are left): a torch CUDA worker allocates a deterministic tensor
#     (GPU_CHECK_MIB MiB, default 256) and prints its checksum when sent SIGUSR1. Then, via our
#     helper, each call timed (one run = one driver attach; CRIU's freeze timeout is sized from
#     it): get-restore-tid of a non-CUDA PID (must fail, exit 1) -> get-state running ->
#     get-restore-tid -> lock --timeout 10000 -> checkpoint (GPU memory released per nvidia-smi,
#     no /dev/nvidia* fds left) -> restore (memory back) -> unlock -> same checksum.
#   part B (the CLI, for contrast, when time is left): a fresh worker dumped with `criu dump
#     -L <plugin dir>`, `criu restore --restore-detached`; same checksum, GPU memory back.
#
# Verdict (verdict(), unit-tested: `bash scripts/gpu_check.sh --verdict RESULTS.tsv`):
#   PASS (exit 0) only when part C's CRIU dump, restore, wake and same-output steps passed and
#   nothing failed or was not run; FAIL (exit 1) when any check failed; NOT RUN (exit 3) with the
#   reasons otherwise: no GPU, gVisor, not root, no carried CRIU, `criu check` failing, no `ip`,
#   no wheels, too little time left, or a dry run with the fake driver.
#
# Usage:  bash scripts/gpu_check.sh [--verdict FILE]
#   env: OUT, PYTHON, GPU_CHECK_MIB, GPU_CHECK_BUDGET_S, GPU_CHECK_USER (default vllm-snapshot),
#   GPU_CHECK_NVML=0 (no NVML call in part C's child), GPU_CHECK_REMAP=0 (part C restores without
#   the identity device map), GPU_CHECK_CARRY (default <repo>/.criu-carry),
#   GPU_CHECK_FAKE=1 (CPU dry run for tests: the fake driver of tests/fakecuda, parts C and D
#   run through real CRIU, parts A and B not run, the verdict at best NOT RUN).
# `[ test ] && result PASS ... || result FAIL ...` is safe here: result() always returns 0.
# shellcheck disable=SC2015
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=gpu_check_lib.sh
. "$(dirname "$0")/gpu_check_lib.sh" || exit 3

if [ "${1:-}" = "--verdict" ]; then
  [ -f "${2:-}" ] || { echo "usage: $0 --verdict RESULTS.tsv (no such file: '${2:-}')" >&2; exit 2; }
  verdict "$2"; exit $?
fi

START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-240}
DEADLINE=$((START + BUDGET))
MIB=${GPU_CHECK_MIB:-256}
PY=${PYTHON:-python3}
FAKE=${GPU_CHECK_FAKE:-0}
ENGINE_USER=${GPU_CHECK_USER:-vllm-snapshot}
REPO=$(cd "$(dirname "$0")/.." && pwd)
CARRY=${GPU_CHECK_CARRY:-$REPO/.criu-carry}
if [ -z "${OUT:-}" ]; then OUT=$(mktemp -d /tmp/gpu-check-out.XXXXXX); fi
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
RESULTS_FILE=$OUT/results.tsv
: >"$LOG"
: >"$RESULTS_FILE"
WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)
chmod 0755 "$WORK"
PIDS_TO_KILL=()
cd "$REPO" || exit 3

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
  local code=$1 v
  [ "$code" -ne 0 ] && [ "$code" -ne 3 ] && result FAIL "gpu_check.sh" "stopped early (exit $code): see gpu_check.log"
  {
    echo "================ gpu_check summary ($(($(date +%s) - START)) s of $BUDGET s) ================"
    verdict "$RESULTS_FILE"; echo "rc=$?" >"$WORK/verdict.rc"
  } | tee -a "$LOG"
  v=$(cut -d= -f2 "$WORK/verdict.rc" 2>/dev/null)
  pack
  cleanup
  trap - EXIT
  exit "${v:-1}"
}
trap 'log "interrupted"; summary_and_exit 130' INT TERM
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
[ "$(id -u)" -eq 0 ] || precondition "must run as root (cuda-checkpoint of another process and CRIU need it)"
if [ "$FAKE" = 1 ]; then
  result DRYRUN "fake driver" "GPU_CHECK_FAKE=1: tests/fakecuda instead of a GPU; parts A and B need one"
  export PYTHONPATH="$REPO/tests/fakecuda${PYTHONPATH:+:$PYTHONPATH}" FAKE_CUDA_DIR=${FAKE_CUDA_DIR:-$WORK/fakecuda}
  mkdir -p "$FAKE_CUDA_DIR"
  vers="dry run: $("$PY" -c 'import platform; print("python", platform.python_version())' 2>&1)"
else
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    precondition "no GPU: nvidia-smi is not installed on this host"
  fi
  if ! smi_l=$(timeout 30 nvidia-smi -L 2>&1) || ! grep -q '^GPU ' <<<"$smi_l"; then
    precondition "no GPU: \`nvidia-smi -L\` lists none: $(head -c 300 <<<"$smi_l")"
  fi
  log "GPUs: $smi_l"
  if ! vers=$(timeout 120 "$PY" -W ignore -c '
import torch, cuda.bindings, platform
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "cuda-bindings", cuda.bindings.__version__, "cuda_available", torch.cuda.is_available())
' 2>&1); then
    precondition "$PY cannot import torch and cuda.bindings: $(tail -c 300 <<<"$vers")"
  fi
  log "$vers"
  grep -q "cuda_available True" <<<"$vers" || precondition "no GPU: torch.cuda.is_available() is False"
fi
{
  echo "## versions"; echo "$vers"
  echo "## nvidia-smi"; timeout 30 nvidia-smi 2>&1
  echo "## persistence"; timeout 30 nvidia-smi -q 2>&1 | grep -i persistence
  echo "## kernel"; uname -a
  echo "## os"; head -n 2 /etc/os-release 2>/dev/null; ldd --version 2>&1 | head -n 1
  echo "## caps"; grep -i '^cap' /proc/self/status
  echo "## /proc/driver/nvidia/gpus"; ls /proc/driver/nvidia/gpus 2>&1
  echo "## LD_LIBRARY_PATH"; echo "${LD_LIBRARY_PATH:-<unset>}"
  echo "## ldconfig -p | grep -E 'libcuda|libnvidia-ml'"; { ldconfig -p 2>&1 || true; } | grep -E 'libcuda|libnvidia-ml'
  echo "## command -v ip"; command -v ip || echo "<none>"
  echo "## python packages (the image's, before the carried wheels)"
  "$PY" -c 'import google.protobuf, psutil; print("protobuf", google.protobuf.__version__, "psutil", psutil.__version__)' 2>&1
  "$PY" -c 'import pydantic, blake3; print("pydantic", pydantic.VERSION, "blake3", blake3.__version__)' 2>&1 | tail -n 1
  echo "## /proc/self/mountinfo"; cat /proc/self/mountinfo
} >"$OUT/environment.txt" 2>&1
log "environment written to environment.txt (in gpu_check.tgz)"

HELPER=("$PY" -W ignore -m vllm_snapshot.checkpoint.cuda_checkpoint)
# helper ARGS...: stdout+stderr of the helper, its exit code; each run's wall time goes to the log
helper() {
  local t0 rc
  t0=$(ms_now)
  tmo 60 "${HELPER[@]}" "$@" </dev/null; rc=$?
  printf '%s helper %s -> exit %s in %s ms\n' "$(date +%H:%M:%S)" "$*" "$rc" "$(($(ms_now) - t0))" >>"$OUT/helper-timings.txt"
  return $rc
}

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
  mem_moved "A GPU memory released" "$used_run" "$used_ckpt" down
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
  [ "$st" = "locked" ] && result PASS "A restore" "${ms} ms, state locked" || result FAIL "A restore" "state '$st'"
  mem_moved "A GPU memory back" "$used_ckpt" "$used_rest" up

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

# ---------------------------------------------------------------- carried prerequisites ------
CRIU_OK=0
C_PY_PATH=""
criu_setup() {
  local libdir out rc f soname have first site wheels
  if [ ! -f "$CARRY/bin/criu" ]; then
    result NOTRUN "C/B CRIU" "no carried CRIU at $CARRY/bin/criu (run scripts/gpu_carry.sh here, then carry=[\".criu-carry\"])"
    return
  fi
  log "== carried prerequisites (CRIU, ip, wheels, engine user)"
  cp "$CARRY/MANIFEST" "$OUT/criu-carry.MANIFEST" 2>/dev/null
  # a CRIU source layout (<src>/criu/criu, <src>/plugins/cuda/cuda_plugin.so): how the product
  # pairs a binary with its plugin (vllm_snapshot.checkpoint.criu.find_cuda_plugin)
  CRIU_SRC=$WORK/criu-src
  mkdir -p "$CRIU_SRC/criu" "$CRIU_SRC/plugins/cuda"
  CRIU_BIN=$CRIU_SRC/criu/criu
  cp "$CARRY/bin/criu" "$CRIU_BIN"; chmod 0755 "$CRIU_BIN"
  cp "$CARRY/plugins/cuda_plugin.so" "$CRIU_SRC/plugins/cuda/"
  libdir=$WORK/criu-lib; mkdir -p "$libdir"
  have=$(ldconfig -p 2>/dev/null)  # one read: `ldconfig -p | grep -q` can die of SIGPIPE under pipefail
  for f in "$CARRY"/lib/*; do
    [ -e "$f" ] || continue
    soname=$(basename "$f")
    grep -q "^[[:space:]]*$soname " <<<"$have" || ln -s "$f" "$libdir/$soname"
  done
  log "carried libraries used (missing on this host): $(find "$libdir" -mindepth 1 -printf '%f ')"
  # appended: the host's own libraries (and the image's driver directories) win
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$libdir"
  if ! out=$(tmo 30 "$CRIU_BIN" --version 2>&1); then
    result NOTRUN "C/B criu runs here" "$(tail -c 300 <<<"$out")"; return
  fi
  result PASS "C/B criu runs here" "$(tr '\n' ' ' <<<"$out")"
  tmo 60 "$CRIU_BIN" check >"$OUT/criu-check.txt" 2>&1; rc=$?
  if [ $rc -ne 0 ]; then  # stop at the first failed prerequisite, with its reason
    first=$(grep -a -m1 -E 'Error|error|fail' "$OUT/criu-check.txt" | head -c 300)
    result NOTRUN "C/B criu check" "exit $rc: ${first:-see criu-check.txt}"
    return
  fi
  result PASS "C/B criu check" "$(tail -n1 "$OUT/criu-check.txt" | head -c 120)"
  # CRIU saves and restores the engine's network namespace with `ip` (criu/net.c run_ip_tool:
  # $CR_IP_TOOL, else `ip` from PATH); the carried one first, so the path is the same everywhere
  if [ -x "$CARRY/bin/ip" ]; then
    export CR_IP_TOOL=$CARRY/bin/ip
  elif command -v ip >/dev/null 2>&1; then
    export CR_IP_TOOL; CR_IP_TOOL=$(command -v ip)
  else
    result NOTRUN "C/B ip" "no \`ip\` here and none carried (run scripts/gpu_carry.sh on a host with iproute2)"
    return
  fi
  if out=$(tmo 30 "$CR_IP_TOOL" -V 2>&1); then
    result PASS "C/B ip runs here" "CR_IP_TOOL=$CR_IP_TOOL: $out"
  else
    result NOTRUN "C/B ip runs here" "CR_IP_TOOL=$CR_IP_TOOL: $(tail -c 300 <<<"$out")"
    return
  fi
  # the wheels of what the product's modules import and the image lacks (pydantic, blake3, ...)
  site=$WORK/site
  wheels=("$CARRY"/wheels/*.whl)
  if [ ! -e "${wheels[0]}" ]; then
    result NOTRUN "C wheels" "none carried in $CARRY/wheels (run scripts/gpu_carry.sh)"
    return
  fi
  if ! out=$(tmo 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${wheels[@]}" 2>&1); then
    result NOTRUN "C wheels install" "pip install --no-index --target failed: $(tail -c 400 <<<"$out")"
    return
  fi
  C_PY_PATH="$site:$CARRY/python"
  if ! out=$(PYTHONPATH="$C_PY_PATH${PYTHONPATH:+:$PYTHONPATH}" tmo 60 "$PY" -c '
import sys; sys.path.insert(0, sys.argv[1])
import pydantic, blake3, psutil, pycriu, google.protobuf
from vllm_snapshot.checkpoint import mountpolicy, inventory; from vllm_snapshot.effects import tools; from vllm_snapshot.supervise import supervisor; from vllm_snapshot.host import privilege
print("pydantic", pydantic.VERSION, "from", pydantic.__file__, "blake3", blake3.__version__, "psutil", psutil.__version__,
      "protobuf", google.protobuf.__version__)' "$REPO" 2>&1); then
    result NOTRUN "C product modules import" "with the carried wheels and pycriu: $(tail -c 400 <<<"$out")"
    return
  fi
  result PASS "C product modules import" "$out"
  if ! HDIR=$("$PY" -c 'import sys; from vllm_snapshot.checkpoint.cuda_checkpoint import helper_dir; print(helper_dir(sys.argv[1]))' "$WORK/cache" 2>&1); then
    result FAIL "C/B helper_dir" "$HDIR"; return
  fi
  out=$(PATH="$HDIR:$PATH" tmo 60 cuda-checkpoint -h 2>&1) && grep -q -- --action <<<"$out" \
    && result PASS "C/B wrapper on PATH" "$HDIR/cuda-checkpoint" || { result FAIL "C/B wrapper on PATH" "$out"; return; }
  if [ ! -d /proc/driver/nvidia/gpus ]; then
    export CRIU_FAULT=138  # FI_PLUGIN_CUDA_FORCE_ENABLE: the plugin's GPU test needs this dir
    log "no /proc/driver/nvidia/gpus: forcing the CUDA plugin on (CRIU_FAULT=138); note: vllm-snapshot itself" \
        "(gpu.engine_device, doctor) would call this host a CPU host"
  fi
  # the engine user: the product's default one, made as scripts/setup.sh makes it when missing
  if ! id -u "$ENGINE_USER" >/dev/null 2>&1; then
    if [ "$ENGINE_USER" = vllm-snapshot ] && command -v useradd >/dev/null 2>&1 \
        && out=$(useradd --system --user-group --home-dir /var/lib/vllm-snapshot-engine --create-home \
                 --shell /usr/sbin/nologin vllm-snapshot 2>&1); then
      log "created the engine user vllm-snapshot (as scripts/setup.sh does)"
    else
      result NOTRUN "C engine user" "no user $ENGINE_USER and none could be made: ${out:-no useradd}"
      return
    fi
  fi
  result PASS "C engine user" "$(id "$ENGINE_USER")"
  CRIU_OK=1
}
criu_setup

# results_of FILE: the `RESULT STATUS NAME[: DETAIL]` lines of a harness's output as results
# (a NAME holds no ": ")
results_of() {
  local st rest
  while read -r _ st rest; do
    if [[ $rest == *": "* ]]; then result "$st" "${rest%%: *}" "${rest#*: }"; else result "$st" "$rest"; fi
  done < <(grep '^RESULT ' "$1")
}

# ---------------------------------------------------------------- part C: the product's way ----
partC() {
  local rc args=()
  [ "$CRIU_OK" -eq 1 ] || return
  if [ "$(remaining)" -lt 100 ]; then
    result NOTRUN "C product invocation" "too little time left: $(remaining) s of the budget (needs 100 s)"; return
  fi
  log "== part C: the product's dump/restore of a tree in its own namespaces, as the engine user, asleep at level 2"
  [ "$FAKE" = 1 ] && args+=(--fake)
  [ "${GPU_CHECK_NVML:-1}" = 0 ] && args+=(--no-nvml)
  [ "${GPU_CHECK_REMAP:-1}" = 0 ] && args+=(--no-remap)
  PYTHONPATH="$C_PY_PATH${PYTHONPATH:+:$PYTHONPATH}" tmo 200 "$PY" -W ignore "$REPO/scripts/gpu_check_tree.py" \
    --criu "$CRIU_BIN" --user "$ENGINE_USER" --out "$OUT" --mib "$MIB" "${args[@]+"${args[@]}"}" >"$OUT/partC.txt" 2>&1; rc=$?
  results_of "$OUT/partC.txt"
  [ $rc -eq 0 ] || result FAIL "C product invocation" "exit $rc (see partC.txt: $(grep -v '^RESULT ' "$OUT/partC.txt" | tail -n 3 | tr '\n' ' ' | tail -c 400))"
}
partC

# ---------------------------------------------------------------- part D: the product's create/restore --
partD() {
  local rc args=() fc=${FAKE_CUDA_DIR:-}
  [ "$CRIU_OK" -eq 1 ] || return
  # not yet what the verdict rests on (part C is): too little time is no reason to say NOT RUN
  if [ "$(remaining)" -lt 90 ]; then
    result INFO "D ops.create/ops.restore" "not run: $(remaining) s of the budget left (needs 90 s; GPU_CHECK_BUDGET_S=360 gives it time)"
    return
  fi
  log "== part D: ops.create + ops.restore + ops.stop_engines of a protocol-speaking engine (vllm_snapshot.dev.gpu_engine)"
  if [ "$FAKE" = 1 ]; then args+=(--fake); fc=$FAKE_CUDA_DIR/partD; mkdir -p "$fc"; fi  # the fake driver's log: D's own
  PYTHONPATH="$C_PY_PATH${PYTHONPATH:+:$PYTHONPATH}" FAKE_CUDA_DIR=$fc tmo 200 "$PY" -W ignore "$REPO/scripts/gpu_check_ops.py" \
    --criu "$CRIU_BIN" --user "$ENGINE_USER" --out "$OUT" --mib "$MIB" "${args[@]+"${args[@]}"}" >"$OUT/partD.txt" 2>&1; rc=$?
  results_of "$OUT/partD.txt"
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then  # the budget ran out under it: said, not counted against the verdict
    result INFO "D product create/restore" "stopped by the budget (exit $rc; GPU_CHECK_BUDGET_S=360 gives it time): see partD.txt"
  elif [ $rc -ne 0 ]; then
    result FAIL "D product create/restore" "exit $rc (see partD.txt: $(grep -v '^RESULT ' "$OUT/partD.txt" | tail -n 3 | tr '\n' ' ' | tail -c 400))"
  fi
}
partD

# ---------------------------------------------------------------- part E: the weights file on the GPU --
partE() {
  [ "$FAKE" != 1 ] || return  # torch on the fake driver has no device
  if [ "$(remaining)" -lt 30 ]; then
    result INFO "E weights file on the GPU" "not run: $(remaining) s of the budget left (needs 30 s)"; return
  fi
  log "== part E: the weights file's write from the GPU and the wake's fill back into the same storages"
  tmo 60 "$PY" -W ignore "$REPO/scripts/gpu_check_weights.py" --out "$WORK" --mib "$MIB" >"$OUT/partE.txt" 2>&1
  local rc=$?
  results_of "$OUT/partE.txt"
  [ $rc -eq 0 ] || result FAIL "E weights file on the GPU" "exit $rc (see partE.txt: $(tail -n 3 "$OUT/partE.txt" | tr '\n' ' ' | tail -c 400))"
}
partE

# part A after parts C, D and E: the verdict rests on C, so C gets the budget first; A (our helper alone
# against the driver) tells why C failed when it did, and runs when time is left
if [ "$FAKE" != 1 ]; then
  if [ "$(remaining)" -lt 60 ]; then
    result INFO "A helper alone" "not run: $(remaining) s of the budget left"
  else
    log "== part A: lock/checkpoint/restore/unlock with our cuda-checkpoint"
    out=$(helper -h 2>&1); rc=$?
    if [ $rc -eq 0 ] && grep -q -- '--action' <<<"$out"; then result PASS "helper -h"; else result FAIL "helper -h" "rc=$rc $out"; fi
    partA
  fi
fi

# ---------------------------------------------------------------- part B: the criu CLI ---------
partB() {
  local ref a img pid_r used_run used_dump used_rest t0 ms rc st
  [ "$CRIU_OK" -eq 1 ] && [ "$FAKE" != 1 ] || return
  # for contrast only (the verdict rests on part C): too little time is no reason to say NOT RUN
  if [ "$(remaining)" -lt 60 ]; then result INFO "B criu CLI" "not run: $(remaining) s of the budget left"; return; fi
  log "== part B: criu dump/restore (CLI, -L) with the CUDA plugin and our helper"
  local CRIU=("$CRIU_BIN") plugdir=$CRIU_SRC/plugins/cuda hdir=$HDIR
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
  result PASS "B criu dump" "${ms} ms, images $(du -sh "$img" | cut -f1), memory.used ${used_run:-N/A} -> ${used_dump:-N/A} MiB"
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
  result PASS "B criu restore" "${ms} ms, pid ${pid_r} (dumped ${WPID}), memory.used ${used_rest:-N/A} MiB"
  st=$(helper --get-state --pid "$pid_r" 2>&1)
  [ "$st" = "running" ] && result PASS "B restored process is running" || result FAIL "B restored state" "'$st'"
  a=$(ask "$pid_r" "$WOUT" 2)
  [ "$a" = "$ref" ] && result PASS "B same checksum after criu restore" "$a" || result FAIL "B checksum after criu restore" "'$a' vs '$ref'"
  mem_moved "B GPU memory back" "$used_dump" "$used_rest" up
  kill -TERM "$pid_r" 2>/dev/null
  cp "$WOUT" "$OUT/b.out" 2>/dev/null
}
partB

summary_and_exit 0
