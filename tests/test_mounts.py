"""engine/mounts.py: which tmpfs mounts the engine's namespace detaches (pure parts), and the
real thing in a throwaway mount namespace (root only)."""

import json
import os
import subprocess
import sys

import pytest

from vllm_snapshot.engine.mounts import tmpfs_mounts, to_detach

MOUNTINFO = """\
22 1 0:21 / / rw,relatime - ext4 /dev/vda rw
24 22 0:5 / /dev rw,nosuid - devtmpfs udev rw
25 24 0:23 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw
30 25 0:27 / /dev/shm rw - tmpfs tmpfs rw
31 22 0:28 / /sys/fs/cgroup ro - tmpfs tmpfs ro
40 22 0:29 / /run rw,nosuid shared:5 - tmpfs tmpfs rw,mode=755
41 40 0:30 / /run/user/1000 rw - tmpfs tmpfs rw
42 22 0:31 / /mnt/with\\040space rw - tmpfs tmpfs rw
43 22 0:32 / /tmp rw - tmpfs tmpfs rw
"""


def test_tmpfs_mounts_parses_optional_fields_and_escapes():
    assert tmpfs_mounts(MOUNTINFO) == ["/dev/shm", "/dev/shm", "/sys/fs/cgroup", "/run", "/run/user/1000",
                                       "/mnt/with space", "/tmp"]


def test_to_detach_keeps_dev_and_sys_and_goes_deepest_first():
    got = to_detach(tmpfs_mounts(MOUNTINFO))
    assert "/sys/fs/cgroup" not in got and "/dev" not in got
    assert set(got) == {"/dev/shm", "/run", "/run/user/1000", "/mnt/with space", "/tmp"}
    assert got.index("/run/user/1000") < got.index("/run")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a mount namespace")
def test_make_private_in_a_new_mount_namespace():
    import tempfile

    inductor = tempfile.mkdtemp(prefix="vllm-snapshot-inductor-", dir="/var/tmp")  # not under /tmp
    from vllm_snapshot.engine.mounts import ENGINE_TMPDIR

    os.makedirs(ENGINE_TMPDIR, mode=0o700, exist_ok=True)
    host_marker = "/dev/shm/vllm-snapshot-test-marker"
    with open(host_marker, "w") as f:
        f.write("host")
    try:
        code = ("import os; from vllm_snapshot.engine.mounts import make_private, tmpfs_mounts;"
                "from vllm_snapshot.engine.mounts import ENGINE_TMPDIR;"
                "make_private(); print(sorted(os.listdir('/dev/shm')), sorted(os.listdir(ENGINE_TMPDIR)),"
                "os.path.islink(ENGINE_TMPDIR + '/torchinductor_root'))")
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor}
        p = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", code],
                           capture_output=True, text=True, env=env, timeout=60)
        assert p.returncode == 0, p.stderr
        assert p.stdout.split() == ["[]", "['torchinductor_root']", "True"]
        assert os.path.exists(host_marker)  # the host's /dev/shm is untouched
    finally:
        os.unlink(host_marker)
        os.rmdir(inductor)


# ---------------------------------------------------------------------------- mount policy

from vllm_snapshot.checkpoint import mountpolicy as mp  # noqa: E402
from vllm_snapshot.engine import mounts as M  # noqa: E402

#: A host like a real one: systemd pseudo mounts, vfat /boot/efi behind autofs, a snap
#: squashfs, the model on an ext4 data disk with a shard disk inside the model dir, an NFS
#: share, a ramfs, the venv under a tmpfs /opt with a disk inside it.
HOST = """\
1 0 254:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
2 1 0:22 / /sys rw,nosuid shared:2 - sysfs sysfs rw
3 1 0:21 / /proc rw,nosuid shared:3 - proc proc rw
4 1 0:5 / /dev rw,nosuid shared:4 - devtmpfs udev rw
5 4 0:23 / /dev/shm rw shared:5 - tmpfs tmpfs rw
6 4 0:24 / /dev/pts rw shared:6 - devpts devpts rw,mode=620
7 2 0:26 / /sys/fs/cgroup rw shared:7 - cgroup2 cgroup2 rw
8 2 0:27 / /sys/fs/bpf rw shared:8 - bpf bpf rw
9 2 0:12 / /sys/kernel/tracing rw shared:9 - tracefs tracefs rw
10 2 0:7 / /sys/kernel/debug rw shared:10 - debugfs debugfs rw
11 4 0:28 / /dev/hugepages rw shared:11 - hugetlbfs hugetlbfs rw
12 4 0:19 / /dev/mqueue rw shared:12 - mqueue mqueue rw
13 3 0:29 / /proc/sys/fs/binfmt_misc rw shared:13 - autofs systemd-1 rw,fd=29
14 1 0:30 / /boot/efi rw shared:14 - autofs systemd-1 rw,fd=40
15 14 259:2 / /boot/efi rw shared:15 - vfat /dev/nvme0n1p1 rw
16 1 7:0 / /snap/core/1 ro shared:16 - squashfs /dev/loop0 ro
17 1 259:3 / /mnt/data rw shared:17 - ext4 /dev/nvme1n1 rw
18 17 7:1 / /mnt/data/model/shard rw shared:18 - ext4 /dev/loop1 rw
19 1 0:40 / /srv/nfs rw shared:19 - nfs4 fs1:/export rw
20 1 0:41 / /mnt/ram rw - ramfs ramfs rw
21 1 0:42 / /opt rw - tmpfs tmpfs rw
22 21 259:4 / /opt/venv rw - xfs /dev/nvme2n1 rw
23 1 0:43 / /run rw,nosuid - tmpfs tmpfs rw,mode=755
24 2 0:44 / /sys/fs/fuse/connections rw - fusectl fusectl rw
"""
NEEDED = ["/mnt/data/model", "/opt/venv", "/usr/lib/python3.11", "/root/.cache", "/"]


def _actions(text=HOST, needed=NEEDED):
    return {m.mount_point + ("" if m.fs_type != "vfat" else "#vfat"): a for m, a, _ in M.classify(M.parse_mountinfo(text), needed)}


def test_parse_mountinfo_records():
    ms = M.parse_mountinfo(HOST + "99 1 0:50 /sub /mnt/with\\040space rw - ext4 /dev/x\\040y rw,errors=ro\n")
    m = ms[-1]
    assert (m.mount_id, m.parent_id, m.major_minor, m.root, m.mount_point, m.fs_type, m.source, m.super_options) == \
        (99, 1, "0:50", "/sub", "/mnt/with space", "ext4", "/dev/x y", "rw,errors=ro")
    assert m.is_bind_of_subtree and ms[0].options == "rw,relatime"
    assert M.parse_mountinfo("garbage\n1 2 3\n") == []


def test_classify_keeps_pseudo_and_root_detaches_the_rest():
    a = _actions()
    for keep in ("/", "/sys", "/proc", "/dev", "/dev/pts", "/sys/fs/cgroup", "/dev/mqueue"):
        assert a[keep] == M.KEEP_ACTION, keep
    for det in ("/dev/shm", "/sys/fs/bpf", "/sys/kernel/tracing", "/sys/kernel/debug", "/dev/hugepages",
                "/proc/sys/fs/binfmt_misc", "/boot/efi", "/boot/efi#vfat", "/snap/core/1", "/srv/nfs", "/mnt/ram",
                "/run", "/sys/fs/fuse/connections"):
        assert a[det] == M.DETACH, det


def test_classify_externals_needed_mounts_nested_ones_and_parents():
    got = {m.mount_point: (a, why) for m, a, why in M.classify(M.parse_mountinfo(HOST), NEEDED)}
    assert got["/mnt/data"][0] == M.EXTERNAL and "holds /mnt/data/model" in got["/mnt/data"][1]
    assert got["/mnt/data/model/shard"][0] == M.EXTERNAL and "inside /mnt/data/model" in got["/mnt/data/model/shard"][1]
    assert got["/opt/venv"][0] == M.EXTERNAL
    # a tmpfs parent of a needed mount cannot be detached (it would take the child along)
    assert got["/opt"][0] == M.EXTERNAL and "parent of /opt/venv" in got["/opt"][1]


def test_classify_needed_nfs_is_external_and_refusals():
    a = _actions(needed=["/srv/nfs/models/x"])
    assert a["/srv/nfs"] == M.EXTERNAL
    for needed, mpt in (("/dev/shm/model", "/dev/shm"), ("/var/tmp/.vllm-snapshot-engine/m", "/")):
        got = {m.mount_point: (a, why) for m, a, why in M.classify(M.parse_mountinfo(HOST), [needed])}
        assert got[mpt][0] == M.REFUSE and "private tmpfs" in got[mpt][1], needed
    fuse = HOST + "30 1 0:60 / /mnt/sshfs rw - fuse.sshfs me@h:/m rw\n31 1 0:61 / /mnt/we]ird rw - ext4 /dev/sdz rw\n"
    a = _actions(fuse, ["/mnt/sshfs/model", "/mnt/we]ird/m"])
    assert a["/mnt/sshfs"] == M.REFUSE and a["/mnt/we]ird"] == M.REFUSE
    a = _actions(needed=["/boot/efi/model"])  # behind an automount trigger
    assert a["/boot/efi"] == M.REFUSE and a["/boot/efi#vfat"] == M.EXTERNAL
    lines = mp.create_refusals(fuse, ["/mnt/sshfs/model"])
    assert lines == ["/mnt/sshfs (fuse.sshfs me@h:/m): holds /mnt/sshfs/model, but fuse.sshfs mounts cannot be "
                     "checkpointed (CRIU 4.2.1 refuses FUSE; an autofs trigger needs its daemon)"]


CONTAINER = """\
1 0 0:50 / / rw - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w
2 1 0:51 / /proc rw - proc proc rw
3 1 0:52 / /dev rw - tmpfs tmpfs rw,mode=755
4 3 0:53 / /dev/pts rw - devpts devpts rw
5 1 0:54 / /sys ro - sysfs sysfs ro
6 5 0:55 / /sys/fs/cgroup ro - cgroup2 cgroup2 rw
7 3 0:56 / /dev/shm rw - tmpfs shm rw
8 1 254:1 /var/lib/docker/containers/abc/hosts /etc/hosts rw - ext4 /dev/vda1 rw
9 1 254:1 /var/lib/docker/containers/abc/resolv.conf /etc/resolv.conf rw - ext4 /dev/vda1 rw
10 1 254:1 /var/lib/docker/containers/abc/hostname /etc/hostname rw - ext4 /dev/vda1 rw
11 1 254:1 /var/lib/models /models ro - ext4 /dev/vda1 rw
12 1 0:57 /secret /run/secrets/token ro - tmpfs tmpfs rw
"""


def test_container_name_files_external_volume_external_dump_externals():
    ms = M.parse_mountinfo(CONTAINER)
    got = {m.mount_point: a for m, a, _ in M.classify(ms, ["/models/llama", "/usr/lib/python3"])}
    assert got["/"] == M.KEEP_ACTION and got["/dev"] == M.KEEP_ACTION and got["/sys/fs/cgroup"] == M.KEEP_ACTION
    assert got["/etc/hosts"] == got["/etc/resolv.conf"] == got["/etc/hostname"] == M.EXTERNAL
    assert got["/models"] == M.EXTERNAL and got["/run/secrets/token"] == M.DETACH
    # what CRIU itself rejects: binds whose file system root is not mounted here (the tmpfs
    # secret is a bind of a subtree of a tmpfs that is not mounted whole in this table)
    assert [m.mount_point for m in M.dump_externals(ms)] == ["/etc/hosts", "/etc/resolv.conf", "/etc/hostname",
                                                             "/models", "/run/secrets/token"]


def test_dump_externals_root_binds_and_native_fs_are_fine():
    ms = M.parse_mountinfo(HOST + "40 1 254:1 /srv/x /srv/y rw - ext4 /dev/vda1 rw\n")
    ext = [m.mount_point for m in M.dump_externals(ms)]
    assert "/srv/y" not in ext and "/" not in ext and "/dev/shm" not in ext and "/sys/kernel/debug" not in ext
    assert {"/mnt/data", "/mnt/data/model/shard", "/boot/efi", "/snap/core/1", "/srv/nfs", "/mnt/ram",
            "/sys/fs/bpf", "/dev/hugepages", "/opt/venv", "/sys/kernel/tracing"} <= set(ext)


def test_hidden_mounts_under_an_overmounted_proc():
    text = ("1 0 254:1 / / rw - ext4 /dev/vda1 rw\n2 1 0:21 / /proc rw - proc proc rw\n"
            "3 2 0:29 / /proc/sys/fs/binfmt_misc rw - binfmt_misc binfmt_misc rw\n"
            "4 2 0:40 / /proc rw - proc proc rw\n")
    ms = M.parse_mountinfo(text)
    assert M._hidden_ids(ms) == {2, 3}
    assert M.mount_of(ms, "/proc/self").mount_id == 4


def test_hidden_prefixes_old_and_new():
    assert "/mnt/data" not in M.hidden_prefixes(HOST)  # without needed paths: tmpfs only (old behaviour)
    new = M.hidden_prefixes(HOST, NEEDED)
    assert "/mnt/ram" in new and "/mnt/data" not in new and "/dev/shm" in new


def test_needed_paths_include_python_packages_caches_and_resolve_symlinks(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    got = M.needed_paths(str(tmp_path / "link"), {"HOME": "/home/u", "HF_HOME": "/data/hf", "TMPDIR": "/x"})
    assert str(tmp_path / "link") in got and str(real) in got
    assert sys.prefix in got and "/home/u/.cache" in got and "/data/hf" in got and "/x" not in got
    assert any(p.endswith("vllm_snapshot") for p in got)


def _rec(mpt="/mnt/data", kind="uuid", ident="u-1", fs="ext4", cookie="vsnap-m0"):
    return mp.ExternalMount(mount_point=mpt, fs_type=fs, source="/dev/sdb", root="/", major_minor="8:16",
                            cookie=cookie, identity_kind=kind, identity=ident)


def test_external_args_and_records_roundtrip():
    rs = [_rec(), _rec("/etc/hosts", cookie="vsnap-m1")]
    assert mp.dump_args(rs) == ("mnt[/mnt/data]:vsnap-m0", "mnt[/etc/hosts]:vsnap-m1")
    assert mp.restore_args(rs) == ("mnt[vsnap-m0]:/mnt/data", "mnt[vsnap-m1]:/etc/hosts")
    assert mp.ExternalMount.model_validate(json.loads(json.dumps(rs[0].model_dump()))) == rs[0]


def test_externals_of_assigns_cookies_and_identities():
    ms = M.parse_mountinfo(HOST)
    got = mp.externals_of(ms, lambda p: "/proc/7/root" + p, identity=lambda m, path: ("fsid", path))
    assert [r.cookie for r in got] == [f"vsnap-m{i}" for i in range(len(got))]
    data = next(r for r in got if r.mount_point == "/mnt/data")
    assert (data.fs_type, data.source, data.identity) == ("ext4", "/dev/nvme1n1", "/proc/7/root/mnt/data")
    with pytest.raises(ValueError, match="cannot name"):
        mp.externals_of(M.parse_mountinfo("1 0 254:1 / / rw - ext4 /dev/vda1 rw\n2 1 8:1 / /a]b rw - ext4 /dev/sda1 rw\n"),
                        lambda p: p, identity=lambda m, path: ("fsid", "1"))


def test_fs_identity_order():
    m = M.parse_mountinfo("17 1 259:3 / /mnt/data rw - ext4 /dev/nvme1n1 rw\n")[0]
    assert mp.fs_identity(m, "/x", uuid_of=lambda mm: "U", fsid_of=lambda p: 5) == ("uuid", "U")
    assert mp.fs_identity(m, "/x", uuid_of=lambda mm: None, fsid_of=lambda p: 5) == ("fsid", "0000000000000005")
    assert mp.fs_identity(m, "/x", uuid_of=lambda mm: None, fsid_of=lambda p: 0) == ("source", "/dev/nvme1n1")
    nfs = M.parse_mountinfo("19 1 0:40 / /srv/nfs rw - nfs4 fs1:/export rw\n")[0]
    assert mp.fs_identity(nfs, "/srv/nfs", uuid_of=lambda mm: "U") == ("source", "fs1:/export")
    assert mp.default_uuid_of("0:40") is None


def test_check_restore_names_mount_point_expected_and_actual():
    ident = {"/mnt/data": ("uuid", "u-1"), "/mnt/data/model/shard": ("uuid", "u-other")}
    fake = lambda m, path: ident.get(m.mount_point, ("fsid", "0"))  # noqa: E731
    assert mp.check_restore([_rec()], HOST, identity=fake) == []
    bad = mp.check_restore([_rec("/mnt/data/model/shard", ident="u-2")], HOST, identity=fake)
    assert bad == ["/mnt/data/model/shard: expected ext4 uuid=u-2, found ext4 uuid=u-other (source /dev/loop1)"]
    missing = mp.check_restore([_rec("/mnt/gone")], HOST, identity=fake)
    assert missing == ["/mnt/gone: expected a mount of ext4 uuid=u-1 (source /dev/sdb), found no mount there "
                       "(the path lies on / (ext4 /dev/vda1))"]
    wrong_type = mp.check_restore([_rec("/mnt/ram")], HOST, identity=fake)
    assert wrong_type == ["/mnt/ram: expected ext4, found ramfs (source ramfs)"]


def test_check_create_raises_usage_error_with_remedy():
    from vllm_snapshot.errors import UsageError

    with pytest.raises(UsageError) as ei:
        mp.check_create("/dev/shm/model", {"HOME": "/root"}, mountinfo=HOST)
    assert "/dev/shm (tmpfs tmpfs)" in ei.value.message and "local disk" in (ei.value.hint or "")
    got = mp.check_create("/mnt/data/model", {"HOME": "/root"}, mountinfo=HOST)
    assert any(m.mount_point == "/mnt/data" and a == M.EXTERNAL for m, a, _ in got)


# ---------------------------------------------------------------------------- the NVIDIA driver

LDCONFIG = """\
1234 libs found in cache `/etc/ld.so.cache'
\tlibz.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libz.so.1
\tlibnvidia-ml.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1
\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1
\tlibcuda.so.1 (libc6) => /usr/lib/i386-linux-gnu/libcuda.so.1
\tlibc.so.6 (libc6,x86-64, OS ABI: Linux 3.2.0) => /lib/x86_64-linux-gnu/libc.so.6
Cache generated by: ldconfig (Ubuntu GLIBC 2.35) stable release version 2.35
"""

#: A Kubernetes GPU container: nvidia-container-toolkit's single-file binds of the driver
#: libraries (from the node's disk) and device nodes (from the node's devtmpfs), a GKE-style
#: driver directory found through LD_LIBRARY_PATH, and a tool the engine does not need.
GPU_CONTAINER = CONTAINER + """\
20 1 254:1 /usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06 /usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06 ro - ext4 /dev/vda1 rw
21 1 254:1 /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.65.06 /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.65.06 ro - ext4 /dev/vda1 rw
22 1 254:1 /usr/lib/x86_64-linux-gnu/libnvidia-ptxjitcompiler.so.580.65.06 /usr/lib/x86_64-linux-gnu/libnvidia-ptxjitcompiler.so.580.65.06 ro - ext4 /dev/vda1 rw
23 1 254:1 /usr/bin/nvidia-smi /usr/bin/nvidia-smi ro - ext4 /dev/vda1 rw
24 3 0:5 /nvidia0 /dev/nvidia0 rw - devtmpfs udev rw
25 3 0:5 /nvidiactl /dev/nvidiactl rw - devtmpfs udev rw
26 1 254:1 /home/kubernetes/bin/nvidia /usr/local/nvidia ro - ext4 /dev/vda1 rw
"""


def test_parse_ldconfig_and_ld_library_dirs():
    got = M.parse_ldconfig(LDCONFIG)
    assert got["libcuda.so.1"] == ["/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib/i386-linux-gnu/libcuda.so.1"]
    assert got["libc.so.6"] == ["/lib/x86_64-linux-gnu/libc.so.6"] and len(got) == 4
    assert M.parse_ldconfig("garbage\n\tx => relative\n") == {}
    assert M.ld_library_dirs({"LD_LIBRARY_PATH": "/usr/local/nvidia/lib64::rel;/opt/x:/usr/local/nvidia/lib64"}) == \
        ["/usr/local/nvidia/lib64", "/opt/x"]
    assert M.ld_library_dirs({}) == []


def test_driver_paths_ld_library_path_cache_resolved_dirs_and_devices(tmp_path):
    real = tmp_path / "drv" / "libcuda.so.580.65.06"
    real.parent.mkdir()
    real.write_text("")
    libdir = tmp_path / "lib"
    libdir.mkdir()
    (libdir / "libcuda.so.1").symlink_to(real)
    env = {"LD_LIBRARY_PATH": "/usr/local/nvidia/lib64"}
    text = f"\tlibcuda.so.1 (libc6,x86-64) => {libdir}/libcuda.so.1\n"
    got = M.driver_paths(env, text, devices=["/dev/nvidia0", "/dev/nvidia-caps"])
    # LD_LIBRARY_PATH first (the loader's order), then the cache; resolved targets and their dirs
    assert got[:2] == [M.LD_CACHE, "/usr/local/nvidia/lib64"]
    assert got.index("/usr/local/nvidia/lib64/libcuda.so.1") < got.index(f"{libdir}/libcuda.so.1")
    for p in (f"{libdir}/libcuda.so.1", str(libdir), str(real), str(real.parent), "/dev/nvidia0", "/dev/nvidia-caps",
              "/usr/local/nvidia/lib64/libnvidia-ml.so.1"):
        assert p in got, p
    assert M.driver_paths({}, "", devices=[]) == [M.LD_CACHE]


def _gpu_actions(monkeypatch, env):
    # the container's loader cache and GPU devices, as the engine would see them there
    from helpers import python_outside_usr

    python_outside_usr(monkeypatch)
    monkeypatch.setattr(M, "ldconfig_cache", lambda: LDCONFIG, raising=False)
    monkeypatch.setattr(M, "nvidia_devices", lambda dev="/dev": ["/dev/nvidia0", "/dev/nvidiactl"], raising=False)
    needed = M.needed_paths(None, env)
    return {m.mount_point: (a, why) for m, a, why in M.classify(M.parse_mountinfo(GPU_CONTAINER), needed)}


def test_needed_paths_keep_the_driver_directory_found_through_ld_library_path(monkeypatch):
    got = _gpu_actions(monkeypatch, {"HOME": "/root", "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64:/usr/local/nvidia/lib"})
    assert got["/usr/local/nvidia"][0] == M.EXTERNAL, got["/usr/local/nvidia"]
    assert "holds /usr/local/nvidia/lib64" in got["/usr/local/nvidia"][1]
    assert _gpu_actions(monkeypatch, {"HOME": "/root"})["/usr/local/nvidia"][0] == M.DETACH  # not on the path


def test_needed_paths_keep_toolkit_file_binds_and_device_binds(monkeypatch):
    got = _gpu_actions(monkeypatch, {"HOME": "/root"})
    for mp_ in ("/usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06", "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.65.06",
                # loaded later by libcuda (the PTX JIT): kept because it sits in the driver's directory
                "/usr/lib/x86_64-linux-gnu/libnvidia-ptxjitcompiler.so.580.65.06",
                "/dev/nvidia0", "/dev/nvidiactl"):
        assert got[mp_][0] == M.EXTERNAL, (mp_, got[mp_])
    assert got["/usr/bin/nvidia-smi"][0] == M.DETACH and got["/dev"][0] == M.KEEP_ACTION
    # CRIU cannot dump these binds (their file systems' roots are not mounted): --external
    ms = M.parse_mountinfo(GPU_CONTAINER)
    ext = {m.mount_point for m in M.dump_externals(ms)}
    assert {"/usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06", "/dev/nvidia0", "/usr/local/nvidia"} <= ext


def test_ldconfig_cache_reads_this_hosts_cache():
    text = M.ldconfig_cache()
    assert "libc.so.6" in M.parse_ldconfig(text)  # glibc lists itself
