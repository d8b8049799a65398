#!/usr/bin/env bash
# Prepare .criu-carry/: a CRIU binary, its CUDA plugin and the shared libraries they need, small
# enough to travel to the lent GPU machine (no network, no criu there; at most 64 MiB carried),
# where scripts/gpu_check.sh uses it for a full `criu dump` / `criu restore` of a CUDA process.
#
# Usage (repo root, after scripts/setup.sh has built CRIU):
#   bash scripts/gpu_carry.sh [CRIU_SRC_DIR]     # default $VLLM_SNAPSHOT_CACHE/criu-4.2.1
# then hand the directory to the device run:  run(command=..., carry=[".criu-carry"])
#
# Layout written (replaced as a whole each time):
#   .criu-carry/.gitignore           "*": the directory ignores itself, so it is never committed
#                                    (third-party binaries) and must be named in `carry`
#   .criu-carry/bin/criu             the CRIU binary, debug info stripped
#   .criu-carry/plugins/cuda_plugin.so   the only .so there: CRIU's -L loads every *.so in a dir
#   .criu-carry/lib/*.so.*           every library `ldd` lists for the two, except glibc's own
#                                    (libc, libm, libdl, libpthread, librt, libresolv, ld-linux,
#                                    vdso), which must come from the GPU host. gpu_check.sh puts on
#                                    criu's LD_LIBRARY_PATH only those whose soname the GPU host
#                                    lacks (`ldconfig -p`), so host libraries win where they exist.
#   .criu-carry/python/pycriu/       CRIU's Python RPC client of the same build (lib/pycriu, with the
#                                    generated rpc_pb2.py): gpu_check.sh's part C runs CRIU through it
#                                    (criu swrk), as vllm-snapshot does. Needs protobuf on the GPU host.
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
CRIU=$SRC/criu/criu
PLUGIN=$SRC/plugins/cuda/cuda_plugin.so
DEST=$REPO/.criu-carry

die() { echo "gpu_carry: $*" >&2; exit 1; }
[ -x "$CRIU" ] || die "no CRIU binary at $CRIU (run scripts/setup.sh, or pass the CRIU source dir)"
[ -f "$PLUGIN" ] || die "no CUDA plugin at $PLUGIN (run \`make cuda_plugin\` in $SRC)"
[ -f "$SRC/lib/pycriu/rpc_pb2.py" ] || die "no generated pycriu at $SRC/lib/pycriu (run \`make lib\` in $SRC)"
command -v ldd >/dev/null || die "ldd not found"

tmp=$(mktemp -d "$REPO/.criu-carry.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/bin" "$tmp/plugins" "$tmp/lib" "$tmp/python/pycriu"
printf '*\n' >"$tmp/.gitignore"
cp "$CRIU" "$tmp/bin/criu"
cp "$PLUGIN" "$tmp/plugins/cuda_plugin.so"
if command -v strip >/dev/null; then
  strip --strip-debug "$tmp/bin/criu" "$tmp/plugins/cuda_plugin.so"
fi
chmod 0755 "$tmp/bin/criu"
(cd "$SRC/lib/pycriu" && find . -name '*.py' -print0 | xargs -0 -I{} cp --parents {} "$tmp/python/pycriu/")

is_glibc() {
  case "$1" in
    linux-vdso.so.*|ld-linux*.so.*|libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|libresolv.so.*) return 0 ;;
  esac
  return 1
}

# `ldd` prints "soname => /path (addr)"; copy the resolved file under its soname.
ldd "$CRIU" "$PLUGIN" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
while read -r soname path; do
  is_glibc "$soname" && continue
  cp -L "$path" "$tmp/lib/$soname"
done
if ldd "$CRIU" "$PLUGIN" | grep -q "not found"; then
  die "ldd reports missing libraries: $(ldd "$CRIU" "$PLUGIN" | grep 'not found' | tr -d '\t' | tr '\n' ' ')"
fi

glibc_need=$( { objdump -T "$tmp/bin/criu" "$tmp/plugins/cuda_plugin.so" 2>/dev/null || true; } |
  grep -o 'GLIBC_[0-9][0-9.]*' | sort -uV | tail -n1)
total=$(du -sb "$tmp" | cut -f1)
{
  echo "source: $SRC"
  echo "criu_version: $("$CRIU" --version 2>/dev/null | awk '/Version:/{print $2}')"
  # shellcheck source=/dev/null
  echo "built_on: $(. /etc/os-release && echo "$PRETTY_NAME"), $(ldd --version | head -n1)"
  echo "needs_glibc: ${glibc_need:-unknown} (of bin/criu and the plugin)"
  echo "total_bytes: $total"
  echo "sha256:"
  (cd "$tmp" && find . -type f ! -name MANIFEST -printf '%P\n' | sort | xargs sha256sum)
} >"$tmp/MANIFEST"

[ "$total" -le "$LIMIT_BYTES" ] || die "$total bytes is over the $LIMIT_BYTES-byte budget (64 MiB carry limit)"
rm -rf "$DEST"
mv "$tmp" "$DEST"
trap - EXIT
echo "gpu_carry: wrote $DEST ($((total / 1024)) KiB, $(find "$DEST/lib" -mindepth 1 -maxdepth 1 | wc -l) libraries, needs ${glibc_need:-?})"
echo "gpu_carry: device run: carry=[\".criu-carry\"], command=\"bash scripts/gpu_check.sh\""
