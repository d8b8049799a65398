#!/bin/sh
# `criu swrk FD` as the unprivileged user whose tree it dumps, keeping every capability root
# has here (ambient set), for CRIU's --unprivileged mode. Used only where root lacks
# CAP_SYS_RESOURCE (containers): CRIU reads each process's rlimits with prlimit(2), which then
# needs the target's ids to equal the caller's real ids (vllm_snapshot/checkpoint/criu/runner.py dump_real_ids).
exec setpriv --reuid "$VLLM_SNAPSHOT_CRIU_RUID" --regid "$VLLM_SNAPSHOT_CRIU_RGID" --clear-groups \
  --inh-caps "$VLLM_SNAPSHOT_CRIU_CAPS" --ambient-caps "$VLLM_SNAPSHOT_CRIU_CAPS" -- \
  "$VLLM_SNAPSHOT_CRIU_BINARY" "$@"
