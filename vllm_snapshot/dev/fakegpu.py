"""The GPU side of this host's tools, for runs with the fake ``cuda.bindings.driver`` of
tests/fakecuda (no GPU, no nvidia-smi): the GPU evidence, room and capacity checks that need a
real GPU, replaced by what the fake driver can answer. Used as
``dataclasses.replace(t, checkpoint=FakeGpuCheckpoint(t.checkpoint.criu), host=FakeGpuHost(t.host.criu))``
over :func:`vllm_snapshot.effects.tools.local_tools` by tests/test_gpu_sequencing.py,
tests/fake_cli.py and ``--fake`` part D of scripts/gpu_check.sh; everything else (CRIU, its
CUDA plugin, our helper, the supervisor, the store) is the real one."""

from __future__ import annotations

from ..effects.checkpoint import LocalCheckpointTools
from ..effects.host import LocalHostTools


class FakeGpuCheckpoint(LocalCheckpointTools):
    """This host's real CRIU side, except the GPU evidence: the fake CUDA engine holds no
    /dev/nvidia* device (there is none here), so every process of the tree is asked, through
    the real helper and the fake driver, whether it has a CUDA context (the real gpu_used asks
    the /dev/nvidia* holders), and the GPU it "uses" is declared (:data:`FAKE_GPU`)."""

    def gpu_used(self, inv):
        from ..checkpoint import gpu
        from ..host.procs import ns_pid

        cuda, _ = gpu.cuda_processes(inv.pids, self.criu.helper(self.criu.runner("cuda").env))
        return gpu.GpuUse(FAKE_GPU, tuple(sorted(ns_pid(p) for p in cuda)), 0, "Fake GPU")

    def check_dump_room(self, inv, gpu_uuid, work_dir):  # no nvidia-smi here: the fake holds no GPU memory
        pass

    def check_gpu_capacity(self, m, uuid):  # no nvidia-smi here
        pass


class FakeGpuHost(LocalHostTools):
    """This host, with the one GPU the fake CUDA engine "uses" (``uuid``: set another one on an
    instance for another GPU of the same model at the same minor, as on another node of the
    class)."""

    uuid = "GPU-0c4a1b2e-0000-4000-8000-000000000000"

    def gpu_uuids(self):
        return [self.uuid]

    def gpu_slots(self):
        from ..checkpoint.gpu import GpuSlot

        return [GpuSlot(self.uuid, "Fake GPU", 0)]


#: The GPU the fake CUDA engine's tree is recorded as using.
FAKE_GPU = FakeGpuHost.uuid
