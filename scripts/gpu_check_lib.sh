# Functions of scripts/gpu_check.sh, in a file of their own so that tests source them
# (tests/test_gpu_check_script.py): the verdict, result records, GPU memory readings, packing.
# Globals they use: LOG, RESULTS_FILE, START, MIB, OUT, WORK (set by gpu_check.sh or the test).
# shellcheck shell=bash

# verdict FILE: the summary of a results file (lines "STATUS<TAB>NAME<TAB>DETAIL"; STATUS one of
# PASS FAIL NOTRUN SKIP INFO DRYRUN) and the verdict line; returns 0 PASS, 1 FAIL, 3 NOT RUN.
# CRIU must have checkpointed and restored a CUDA process through the product's invocation:
# part C's steps below must be there as PASS, else the best verdict is NOT RUN.
VERDICT_REQUIRED=("C criu dump" "C criu restore" "C wake" "C same output after restore + wake")
verdict() {
  local file=$1 st name detail fails=0 notrun=0 dry=0 req missing=() reasons=() n=0 joined
  local -A passed=()
  while IFS=$'\t' read -r st name detail; do
    [ -n "$st" ] || continue
    n=$((n + 1))
    printf '%-6s  %s%s\n' "$st" "$name" "${detail:+: $detail}"
    case "$st" in
      FAIL) fails=$((fails + 1)) ;;
      NOTRUN|SKIP) notrun=$((notrun + 1)); reasons+=("$name${detail:+: $detail}") ;;
      DRYRUN) dry=1; reasons+=("dry run: $name${detail:+: $detail}") ;;
      PASS) for req in "${VERDICT_REQUIRED[@]}"; do
              [[ $name == "$req"* ]] && passed[$req]=1
            done ;;
      INFO) ;;
      *) fails=$((fails + 1)); echo "(unknown status '$st': counted as a failure)" ;;
    esac
  done <"$file"
  for req in "${VERDICT_REQUIRED[@]}"; do [ -n "${passed[$req]:-}" ] || missing+=("$req"); done
  if [ "$fails" -gt 0 ]; then
    echo "GPU_CHECK: FAIL ($fails failed)"; return 1
  fi
  if [ "$notrun" -gt 0 ] || [ "$dry" -eq 1 ] || [ "${#missing[@]}" -gt 0 ] || [ "$n" -eq 0 ]; then
    if [ "${#missing[@]}" -gt 0 ]; then
      joined=$(printf '%s, ' "${missing[@]}")
      reasons+=("CRIU did not checkpoint and restore a CUDA process through the product's invocation (not passed: ${joined%, })")
    fi
    joined=$(printf '%s; ' "${reasons[@]}")
    echo "GPU_CHECK: NOT RUN (${joined%; })"; return 3
  fi
  echo "GPU_CHECK: PASS"; return 0
}

log() { # to stdout and gpu_check.log (with LOG_ONLY=1 set: to gpu_check.log only)
  local line
  line=$(printf '%s [%4ss] %s' "$(date +%H:%M:%S)" "$(($(date +%s) - START))" "$*")
  if [ "${LOG_ONLY:-0}" = 1 ]; then echo "$line" >>"$LOG"; else echo "$line" | tee -a "$LOG"; fi
}
result() { # result PASS|FAIL|SKIP|NOTRUN|INFO|DRYRUN name detail...
  local st=$1 name=$2; shift 2
  local detail="${*//$'\t'/ }"
  printf '%s\t%s\t%s\n' "$st" "$name" "${detail//$'\n'/ }" >>"$RESULTS_FILE"
  log "$st $name${detail:+: $detail}"
  return 0
}

# memory.used of GPU 0 in MiB, or nothing when nvidia-smi does not give a number ("[N/A]" under MIG)
gpu_used_mib() {
  local v
  v=$(timeout 30 nvidia-smi -i 0 --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -n1 | tr -d ' ')
  [[ $v =~ ^[0-9]+$ ]] && echo "$v"
  return 0
}
# mem_moved NAME FROM TO: FROM -> TO must differ by >= 90% of the tensor (TO - FROM when the memory
# must come back, FROM - TO when it must go); INFO, not FAIL, when nvidia-smi gave no number
mem_moved() {
  local name=$1 from=$2 to=$3 dir=$4 delta
  if [ -z "$from" ] || [ -z "$to" ]; then
    result INFO "$name" "not measurable: nvidia-smi memory.used is not a number here ('${from:-N/A}' -> '${to:-N/A}'; MIG?)"
    return 0
  fi
  if [ "$dir" = down ]; then delta=$((from - to)); else delta=$((to - from)); fi
  if [ "$delta" -ge $((MIB * 9 / 10)) ]; then
    result PASS "$name" "memory.used ${from} -> ${to} MiB"
  else
    result FAIL "$name" "memory.used ${from} -> ${to} MiB (tensor ${MIB} MiB)"
  fi
}

# pack: everything in $OUT but gpu_check.log into $OUT/gpu_check.tgz (at most 8 files come back
# from the device, 16 MiB each); files over 4 MiB go in as their last 4 MiB. Says what it did in
# gpu_check.log only, so that the verdict stays the last line of stdout.
pack() {
  local LOG_ONLY=1
  local f tgz=$OUT/gpu_check.tgz
  while IFS= read -r -d '' f; do
    if [ "$(stat -c %s "$f")" -gt $((4 << 20)) ]; then
      tail -c $((4 << 20)) "$f" >"$f.tail" && mv "$f.tail" "$f" && log "packed only the last 4 MiB of ${f#"$OUT"/}"
    fi
  done < <(find "$OUT" -type f ! -name gpu_check.log ! -name gpu_check.tgz -print0)
  if tar -czf "$WORK/gpu_check.tgz" -C "$OUT" --exclude=./gpu_check.log --exclude=./gpu_check.tgz . 2>>"$LOG"; then
    find "$OUT" -mindepth 1 -maxdepth 1 ! -name gpu_check.log -exec rm -rf {} +
    mv "$WORK/gpu_check.tgz" "$tgz"
    log "diagnostics packed into $tgz ($(stat -c %s "$tgz") bytes): $(tar -tzf "$tgz" | grep -v '/$' | tr '\n' ' ')"
  else
    log "could not pack the diagnostics; they stay as files in $OUT (only 8 come back)"
  fi
}
