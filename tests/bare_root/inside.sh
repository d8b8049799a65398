#!/usr/bin/env bash
# Runs inside the bare Debian root (tests/test_bare_root.py), in the checkout at /src, what a
# new user of README's Quick start runs, then checks what setup installed:
#   inside.sh OUT 'PREREQUISITES' PYTEST-ARGS...
#   1. PREREQUISITES: the README's command for a bare machine (`apt-get ... install ... make`)
#   2. `make setup` (the first step of both `make demo` and `make test`): real apt-get, real pip,
#      the real CRIU build
#   3. `vllm-snapshot doctor --json` > OUT/doctor.json (its exit status in OUT/doctor.rc)
#   4. pytest -m "not integration" PYTEST-ARGS, with CI=true (a skip is a failure)
#   5. a copy of the checkout below a 0700 directory (/root/vllm-snapshot): `make setup` again
#      (the engine user needs an ACL there: setfacl)
# Each step appends "LABEL<TAB>EXIT STATUS<TAB>SECONDS" to OUT/steps.tsv; a failed step 1, 2 or
# 5 ends the script with its status, a failed step 4 after step 5.
set -euo pipefail
out=$1 prereq=$2
shift 2
mkdir -p "$out"
: > "$out/steps.tsv"
# timed LABEL COMMAND...: run COMMAND, record how it ended and how long it took
timed() {
  local label=$1 t0=$SECONDS rc=0
  shift
  "$@" || rc=$?
  printf '%s\t%s\t%s\n' "$label" "$rc" "$((SECONDS - t0))" >> "$out/steps.tsv"
  printf '[bare-root] %s: exit %s in %s s\n' "$label" "$rc" "$((SECONDS - t0))" >&2
  return "$rc"
}
cd /src
timed prerequisites bash -c "$prereq"
timed "make setup" make setup
rc=0
timed doctor /var/cache/vllm-snapshot/venv/bin/vllm-snapshot doctor --json > "$out/doctor.json" || rc=$?
echo "$rc" > "$out/doctor.rc"
tests_rc=0
timed "unit tests" env CI=true .venv/bin/python -m pytest -p no:cacheprovider -m "not integration" "$@" || tests_rc=$?
cp -a /src /root/vllm-snapshot
(cd /root/vllm-snapshot && timed "make setup (checkout under /root)" make setup)
exit "$tests_rc"
