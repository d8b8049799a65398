"""engine/mounts.py: which tmpfs mounts the engine's namespace detaches (pure parts), and the
real thing in a throwaway mount namespace (root only)."""

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
