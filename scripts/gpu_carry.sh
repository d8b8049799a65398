#!/usr/bin/env bash
# Prepare .criu-carry/: a CRIU binary, its CUDA plugin, `ip`, the shared libraries they need and
# the Python wheels the lent GPU machine lacks, small enough to travel there (no network, no
# criu, no iproute2, no pydantic/blake3 there; at most 64 MiB carried with the repo), where
# scripts/gpu_check.sh uses it for the product's `criu dump` / `criu restore` of a CUDA tree.
#
# Usage (repo root, after scripts/setup.sh has built CRIU and the venv; pip must reach PyPI):
#   bash scripts/gpu_carry.sh [CRIU_SRC_DIR]     # default $VLLM_SNAPSHOT_CACHE/criu-4.2.1
#   env: GPU_CARRY_PYTHON (the device's Python version for the wheels, default 3.12),
#        GPU_CARRY_VENV_PYTHON (whose package versions to pin, default the setup venv's python)
# then on the device:  bash scripts/gpu_check.sh  with carry=[".criu-carry"], timeout_s 360
#
# Layout written (replaced as a whole each time):
#   .criu-carry/.gitignore           "*": the directory ignores itself, so it is never committed
#                                    (third-party binaries) and must be named in `carry`
#   .criu-carry/bin/criu             the CRIU binary, debug info stripped
#   .criu-carry/plugins/cuda_plugin.so   the only .so there: CRIU's -L loads every *.so in a dir
#   .criu-carry/bin/ip               iproute2's `ip` of this host: CRIU saves and restores the
#                                    engine's network namespace with it (criu/net.c run_ip_tool);
#                                    gpu_check.sh exports it as CR_IP_TOOL
#   .criu-carry/lib/*.so.*           every library `ldd` lists for the three, except glibc's own
#                                    (libc, libm, libdl, libpthread, librt, libresolv, ld-linux,
#                                    vdso), which must come from the GPU host. gpu_check.sh puts on
#                                    criu's LD_LIBRARY_PATH only those whose soname the GPU host
#                                    lacks (`ldconfig -p`), so host libraries win where they exist.
#   .criu-carry/python/pycriu/       CRIU's Python RPC client of the same build (lib/pycriu, with the
#                                    generated rpc_pb2.py): gpu_check.sh's part C runs CRIU through it
#                                    (criu swrk), as vllm-snapshot does. Needs protobuf on the GPU host.
#   .criu-carry/wheels/*.whl         cp312 manylinux x86_64 wheels (`pip download --only-binary=:all:`)
#                                    of what the product's modules used by gpu_check_tree.py and
#                                    gpu_check_ops.py import and the GPU image lacks: pydantic,
#                                    pydantic-core, annotated-types, typing-inspection,
#                                    typing-extensions (pydantic needs a recent one), blake3,
#                                    zstandard -- each at the version of the setup venv, where the
#                                    tests ran. psutil and protobuf are in the image.
#                                    gpu_check.sh installs them with `pip install --no-index --target`.
#   .criu-carry/MANIFEST             source, build host, newest GLIBC symbol version needed, sizes,
#                                    sha256 of every file
#
# The binary needs the GPU host's glibc to be at least the newest GLIBC_x.y it references (written
# in MANIFEST; 2.35 for CRIU 4.2.1 built on Debian 12, i.e. Ubuntu >= 22.04 works).
set -euo pipefail

LIMIT_BYTES=$((60 * 1024 * 1024))   # stay under the 64 MiB carry limit with room for the rest
REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${VLLM_SNAPSHOT_CACHE:-/var/cache/vllm-snapshot}
SRC=${1:-$CACHE/criu-4.2.1}
PYVER=${GPU_CARRY_PYTHON:-3.12}
VENV_PY=${GPU_CARRY_VENV_PYTHON:-$CACHE/venv/bin/python}
#: what gpu_check_tree.py's and gpu_check_ops.py's imports of vllm_snapshot need beyond the GPU
#: image's packages (tests/test_gpu_check_script.py checks this list against a real import)
WHEELS=(pydantic pydantic-core annotated-types typing-inspection typing-extensions blake3 zstandard)
CRIU=$SRC/criu/criu
PLUGIN=$SRC/plugins/cuda/cuda_plugin.so
DEST=$REPO/.criu-carry

die() { echo "gpu_carry: $*" >&2; exit 1; }
[ -x "$CRIU" ] || die "no CRIU binary at $CRIU (run scripts/setup.sh, or pass the CRIU source dir)"
[ -f "$PLUGIN" ] || die "no CUDA plugin at $PLUGIN (run \`make cuda_plugin\` in $SRC)"
[ -f "$SRC/lib/pycriu/rpc_pb2.py" ] || die "no generated pycriu at $SRC/lib/pycriu (run \`make lib\` in $SRC)"
command -v ldd >/dev/null || die "ldd not found"
IP=$(command -v ip || true)
[ -n "$IP" ] || die "no \`ip\` here to carry (apt-get install iproute2)"
[ -x "$VENV_PY" ] || die "no python at $VENV_PY to read the package versions from (set GPU_CARRY_VENV_PYTHON)"

tmp=$(mktemp -d "$REPO/.criu-carry.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/bin" "$tmp/plugins" "$tmp/lib" "$tmp/python/pycriu" "$tmp/wheels"
printf '*\n' >"$tmp/.gitignore"
cp "$CRIU" "$tmp/bin/criu"
cp "$PLUGIN" "$tmp/plugins/cuda_plugin.so"
cp -L "$IP" "$tmp/bin/ip"
if command -v strip >/dev/null; then
  strip --strip-debug "$tmp/bin/criu" "$tmp/plugins/cuda_plugin.so" "$tmp/bin/ip"
fi
chmod 0755 "$tmp/bin/criu" "$tmp/bin/ip"
(cd "$SRC/lib/pycriu" && find . -name '*.py' -print0 | xargs -0 -I{} cp --parents {} "$tmp/python/pycriu/")

is_glibc() {
  case "$1" in
    linux-vdso.so.*|ld-linux*.so.*|libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|libresolv.so.*) return 0 ;;
  esac
  return 1
}

# `ldd` prints "soname => /path (addr)"; copy the resolved file under its soname.
ldd "$CRIU" "$PLUGIN" "$IP" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
while read -r soname path; do
  is_glibc "$soname" && continue
  cp -L "$path" "$tmp/lib/$soname"
done
if ldd "$CRIU" "$PLUGIN" "$IP" | grep -q "not found"; then
  die "ldd reports missing libraries: $(ldd "$CRIU" "$PLUGIN" "$IP" | grep 'not found' | tr -d '\t' | tr '\n' ' ')"
fi

pins=()
for w in "${WHEELS[@]}"; do
  v=$("$VENV_PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$w" 2>/dev/null) \
    || die "$w is not installed in $VENV_PY (run scripts/setup.sh)"
  pins+=("$w==$v")
done
"$VENV_PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$tmp/wheels" "${pins[@]}" \
  || die "pip download of ${pins[*]} for python $PYVER failed (pip must reach PyPI)"

glibc_need=$( { objdump -T "$tmp/bin/criu" "$tmp/plugins/cuda_plugin.so" "$tmp/bin/ip" 2>/dev/null || true; } |
  grep -o 'GLIBC_[0-9][0-9.]*' | sort -uV | tail -n1)
total=$(du -sb "$tmp" | cut -f1)
{
  echo "source: $SRC"
  echo "criu_version: $("$CRIU" --version 2>/dev/null | awk '/Version:/{print $2}')"
  # shellcheck source=/dev/null
  echo "built_on: $(. /etc/os-release && echo "$PRETTY_NAME"), $(ldd --version | head -n1)"
  echo "needs_glibc: ${glibc_need:-unknown} (of bin/criu, bin/ip and the plugin)"
  echo "ip: $IP ($("$IP" -V 2>&1))"
  echo "wheels: python $PYVER: ${pins[*]}"
  echo "total_bytes: $total"
  echo "sha256:"
  (cd "$tmp" && find . -type f ! -name MANIFEST -printf '%P\n' | sort | xargs sha256sum)
} >"$tmp/MANIFEST"

[ "$total" -le "$LIMIT_BYTES" ] || die "$total bytes is over the $LIMIT_BYTES-byte budget (64 MiB carry limit)"
rm -rf "$DEST"
mv "$tmp" "$DEST"
trap - EXIT
echo "gpu_carry: wrote $DEST ($((total / 1024)) KiB, $(find "$DEST/lib" -mindepth 1 -maxdepth 1 | wc -l) libraries," \
  "$(find "$DEST/wheels" -name '*.whl' | wc -l) wheels for python $PYVER, needs ${glibc_need:-?})"
echo "gpu_carry: device run: carry=[\".criu-carry\"], timeout_s=360, command=\"bash scripts/gpu_check.sh\""
