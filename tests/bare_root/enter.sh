#!/usr/bin/env bash
# Enter a bare Debian root (tests/test_bare_root.py): mount what a booted machine has, then
# chroot into it and run COMMAND.
#   enter.sh ROOT [--ro SRC] [--rw SRC DST]... -- COMMAND...
#     --ro SRC      bind the host directory SRC read-only at the same path inside ROOT
#     --rw SRC DST  bind the host directory SRC read-write at DST inside ROOT
# Must run as PID 1 of a new PID namespace in a private mount namespace, as
#   unshare --mount --propagation private --pid --fork --kill-child enter.sh ...
# so every mount made here disappears with the namespace however this ends (nothing is ever
# mounted on the host, nothing needs unmounting) and every process started inside (a daemon a
# package's postinst started) is killed when COMMAND exits. Refuses (exit 2) otherwise.
set -euo pipefail

root=${1:?usage: enter.sh ROOT [--ro SRC] [--rw SRC DST]... -- COMMAND...}
shift
# /proc is still the host's here: /proc/1 is the host's init, /proc/self is this shell
if [ "$$" != 1 ] || [ "$(readlink /proc/self/ns/mnt)" = "$(readlink /proc/1/ns/mnt)" ]; then
  echo "enter.sh: run me as PID 1 of a new PID and mount namespace (unshare -m --propagation private -p -f --kill-child)" >&2
  exit 2
fi
[ -x "$root/bin/sh" ] || { echo "enter.sh: $root is not a root file system" >&2; exit 2; }

# the root a mount of its own, as / is on a machine (CRIU's mount tree needs a parent for every
# mount below it: without this, `criu check` says "mnt: No parent found for mountpoint")
mount --bind "$root" "$root"
mount -t proc proc "$root/proc"              # this PID namespace's processes only
mount --rbind /sys "$root/sys"               # cgroups included: doctor and CRIU read them
mount --rbind /dev "$root/dev"               # the real kernel's devices (loop, pts, ...)
mount -t tmpfs -o mode=1777 tmpfs "$root/dev/shm"   # not the host's /dev/shm
mount -t tmpfs -o mode=0755 tmpfs "$root/run"
mount -t tmpfs -o mode=1777 tmpfs "$root/tmp"
while [ $# -gt 0 ]; do
  case $1 in
    --ro) mkdir -p "$root$2"; mount --bind "$2" "$root$2"; mount -o remount,bind,ro "$root$2"; shift 2 ;;
    --rw) mkdir -p "$root$3"; mount --bind "$2" "$root$3"; shift 3 ;;
    --) shift; break ;;
    *) echo "enter.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "enter.sh: no COMMAND" >&2; exit 2; }
# not exec: PID 1 stays this shell, so COMMAND's exit ends the namespace (and its daemons)
rc=0
chroot "$root" "$@" || rc=$?
exit "$rc"
