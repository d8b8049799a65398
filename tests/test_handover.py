"""``switch`` as a hand-over (issue 32, target 4), through the role seam's fakes: when both
engines fit, the new engine is restored and verified while the old one serves, takes over the
old one's own listening socket, and only then is the old one told to stop; when they do not fit
(host memory, GPU memory) or the socket cannot be shared, today's stop-then-restore runs and
says why; a new engine that fails before the hand-over leaves the old one untouched. The end to
end case (real CRIU + vLLM, a client hammering the port) is in tests/test_switch_integration.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from vllm_snapshot import ops
from vllm_snapshot.errors import BusyError, EngineError, InsufficientResources, OracleMismatchError
from vllm_snapshot.host.resources import Offer
from vllm_snapshot.ops.switch import handover_blocker
from vllm_snapshot.report.progress import Reporter
from vllm_snapshot.store.registry import Entry

from fakes import FakeWorld, isolated_manifest, manifest_with
from helpers import make_oracle

SNAP = Path("/snaps/new")
PORT = 8101


def _old(host="127.0.0.1", pid=77, snap="/snaps/old"):
    return Entry(snap, pid, 0, host, PORT, 0.0, "detached")


def _world(**kw) -> FakeWorld:
    t = FakeWorld(manifest=kw.pop("manifest", None) or isolated_manifest(), **kw)
    t.entries = [_old()]
    return t


def _switch(t: FakeWorld, **kw):
    return ops.switch(SNAP, None, PORT, None, Reporter(), tools=t.tools, **kw)


def test_both_fit_the_new_engine_takes_the_old_socket_before_the_old_one_is_stopped():
    t = _world()
    stop = t.tools.runtime.stop_engine
    t.tools.runtime.stop_engine = lambda e, drain_s=None: (stop(e, drain_s), time.sleep(0.3))[0]  # it drains
    res = _switch(t)
    c = t.calls
    # every check of the restore, the oracle inside the engine included, before the socket is
    # handed over; the old engine is told to stop only then, and /health + the canary come after
    # it stopped accepting (they reach the new engine alone)
    order = ["take_listener", "restore_tree", "engine.oracle", "serve_engine", "accepting", "stop_engine",
             "http_health", "http_canary", "register"]
    assert [x for x in c if x in order] == order
    assert c.index("holds_socket") < c.index("http_health")
    assert t.served_listener is t.listener and t.listener.pid == 77  # the old engine's own socket
    assert t.listener.closed  # our duplicate: the engines hold the port
    assert "port_free" not in c  # the port is ours: never probed (it is taken, by design)
    assert res.handover and res.fallback == "" and res.stopped == [77] and res.pid == 5151
    assert res.to_json()["handover"] is True


def test_host_memory_short_for_both_falls_back_to_stop_then_restore_and_says_why():
    t = _world()
    offers = iter([Offer(10, "MemAvailable 0.00 GiB")])  # the first look: the old engine still holds its memory
    t.tools.host.memory_offer = lambda detached=False: next(offers, t.offer)
    lines = []
    rep = Reporter()
    rep.info = lines.append
    res = ops.switch(SNAP, None, PORT, None, rep, tools=t.tools)
    assert "take_listener" not in t.calls and t.calls.index("stop_engine") < t.calls.index("restore_tree")
    assert not res.handover and res.fallback.startswith("both engines do not fit in memory at once: restoring needs")
    assert any(x.startswith("no hand-over: both engines do not fit in memory") for x in lines), lines


def test_gpu_memory_short_for_both_falls_back_to_stop_then_restore():
    cuda = isolated_manifest()
    cuda = cuda.model_copy(update={"engine": cuda.engine.model_copy(update={"kind": "cuda", "full_state_captured": False})})
    t = _world(manifest=cuda)
    looks = []

    def capacity(m, uuid):
        looks.append(uuid)
        if len(looks) == 1:  # the old engine still holds its GPU memory
            raise BusyError("GPU GPU-1 has 10.0 GiB free, the engine needs 126.0 GiB")

    t.tools.checkpoint.check_gpu_capacity = capacity
    res = _switch(t)
    assert not res.handover and res.fallback.startswith("the GPU has no room for both engines at once")
    assert "take_listener" not in t.calls and t.calls.index("stop_engine") < t.calls.index("restore_tree")


def test_a_cuda_target_that_fits_beside_the_old_engine_is_handed_over():
    cuda = isolated_manifest()
    cuda = cuda.model_copy(update={"engine": cuda.engine.model_copy(update={"kind": "cuda", "full_state_captured": False})})
    t = _world(manifest=cuda)
    res = _switch(t)
    assert res.handover and t.calls.index("restore_tree") < t.calls.index("stop_engine")


@pytest.mark.parametrize("why, setup", [
    ("2 engines serve port", lambda t: t.entries.append(_old(host="::1", pid=78))),
    ("the new engine is to listen on 127.0.0.1, the old one listens on ::1",
     lambda t: t.entries.__setitem__(0, _old(host="::1"))),
    ("the old engine's listening socket cannot be shared (PID 77 holds no socket",
     lambda t: t.fail.__setitem__("take_listener", LookupError("PID 77 holds no socket listening on 127.0.0.1:8101"))),
])
def test_what_cannot_be_handed_over_is_switched_the_old_way(why, setup):
    t = _world()
    setup(t)
    res = ops.switch(SNAP, "127.0.0.1", PORT, None, Reporter(), tools=t.tools)
    assert not res.handover and why in res.fallback
    assert t.calls.index("stop_engine") < t.calls.index("restore_tree")


def test_a_snapshot_that_binds_its_port_itself_is_not_handed_over():
    t = _world(manifest=manifest_with())  # engine.network "host": made before the engine's own namespace
    res = _switch(t)
    assert not res.handover and "binds its port itself" in res.fallback and "take_listener" not in t.calls


def test_a_new_engine_failing_before_the_hand_over_leaves_the_old_one_untouched():
    t = _world(oracles=[make_oracle(token_id=12)])  # the restored engine's oracle differs
    with pytest.raises(OracleMismatchError) as ei:
        _switch(t)
    e = ei.value
    assert "stop_engine" not in t.calls and "serve_engine" not in t.calls and "register" not in t.calls
    assert "was not touched: it still serves http://127.0.0.1:8101" in e.message
    assert e.details["stopped"] == [] and e.details["serving"]["pid"] == 77
    assert t.listener.closed


def test_memory_short_at_the_restore_itself_falls_back_before_anything_was_touched():
    t = _world()
    offers = iter([t.offer, Offer(10, "MemAvailable 0.00 GiB")])  # fits at the decision, not at the restore
    t.tools.host.memory_offer = lambda detached=False: next(offers, t.offer)
    res = _switch(t)
    assert not res.handover and res.fallback.startswith("the restore found too little memory beside the old engine")
    assert t.calls.count("stop_engine") == 1 and t.calls.index("take_listener") < t.calls.index("stop_engine")


def test_handover_blocker_is_none_only_when_everything_allows_it():
    t = _world()
    m = isolated_manifest()
    assert handover_blocker(t.tools, m, [_old()], "127.0.0.1", PORT) is None
    t.offer = Offer(m.sizes["raw"] - 1, "cgroup /vllm-snapshot memory.max")
    assert "cgroup /vllm-snapshot memory.max" in handover_blocker(t.tools, m, [_old()], "127.0.0.1", PORT)
    t.offer = Offer(m.sizes["raw"], "exactly enough")
    assert handover_blocker(t.tools, m, [_old()], "127.0.0.1", PORT) is None


def test_a_new_engine_that_dies_before_it_accepts_leaves_the_old_one_untouched():
    t = _world()
    t.tools.host.accepting = lambda pid, sock: False
    alive = iter([True, True, False])
    orig = t.tools.engine.adopt

    def adopt(*a):
        e = orig(*a)
        e.alive = lambda: next(alive, False)
        return e

    t.tools.engine.adopt = adopt
    with pytest.raises(EngineError, match="exited before it accepted") as ei:
        _switch(t)
    assert "stop_engine" not in t.calls and "http_health" not in t.calls and "register" not in t.calls
    assert "was not touched" in ei.value.message


# ------------------------------------------------------------------ the socket itself (real processes)

_HOLDER = """
import asyncio, socket, sys
sock = socket.socket(fileno=int(sys.argv[1]))
async def main():
    server = await asyncio.get_running_loop().create_server(asyncio.Protocol, sock=sock)
    print("serving", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    server.close()  # what a draining engine does: it accepts no more and drops its descriptor
    print("closed", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
asyncio.run(main())
"""


def test_the_listener_is_taken_shared_and_survives_its_first_holder():
    import socket
    import subprocess
    import sys

    from vllm_snapshot.host import ports

    lst = ports.bind_listener("127.0.0.1", 0)
    port = lst.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(lst.fileno())], pass_fds=(lst.fileno(),),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lst.close()  # the holder alone has it, as an engine after the hand-off
    try:
        assert p.stdout.readline().strip() == "serving"
        with pytest.raises(LookupError, match="another address"):
            ports.take_listener(p.pid, "::1", port)
        shared = ports.take_listener(p.pid, "127.0.0.1", port)
        assert ports.holds_socket(p.pid, shared) and ports.accepting(p.pid, shared)
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "closed"
        assert not ports.holds_socket(p.pid, shared) and not ports.accepting(p.pid, shared)
        # the port still listens: a connection made now waits in the backlog for the next holder
        client = socket.create_connection(("127.0.0.1", port), timeout=2)
        shared.settimeout(2)
        conn, _ = shared.accept()
        conn.close()
        client.close()
        shared.close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2)
    finally:
        p.kill()
        p.wait()


def test_an_engine_whose_socket_is_also_held_elsewhere_still_serves():
    """While a switch holds a duplicate of the old engine's listening socket, the old engine must
    not look like an orphan that serves nothing (a concurrent `prune`/restore would kill it):
    psutil names one holder per socket only -- here the later one."""
    import socket
    import subprocess
    import sys

    import psutil

    from vllm_snapshot.store import registry

    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen()
    holders = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(lst.fileno(),))
               for _ in range(2)]
    lst.close()
    try:
        engine = psutil.Process(holders[0].pid)  # the old engine; holders[1] plays the switch
        assert registry._serves(engine, registry._serving_inodes())
        bare = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            assert not registry._serves(psutil.Process(bare.pid), registry._serving_inodes())
        finally:
            bare.kill()
            bare.wait()
    finally:
        for h in holders:
            h.kill()
            h.wait()


def test_a_hand_over_hashes_the_images_once_in_its_restore_and_a_corrupt_one_leaves_the_old_engine_serving():
    from vllm_snapshot.errors import CorruptSnapshotError

    t = _world()
    res = _switch(t)
    c = t.calls
    # no pass of its own before the restore: the restore's verdict, before the socket is handed over
    assert res.handover and "verify_images" not in c and c.count("checksums") == 1
    assert c.index("checksums") < c.index("serve_engine") < c.index("stop_engine")
    t = _world()
    t.corrupt_images = CorruptSnapshotError("image pages-4.img fails its checksum")
    with pytest.raises(CorruptSnapshotError, match="fails its checksum") as ei:
        _switch(t)
    assert "stop_engine" not in t.calls and "serve_engine" not in t.calls and "register" not in t.calls
    assert "was not touched: it still serves http://127.0.0.1:8101" in ei.value.message
    assert ei.value.details["stopped"] == []


def test_the_old_way_checks_the_images_before_the_old_engine_is_stopped():
    from vllm_snapshot.errors import CorruptSnapshotError

    t = _world()
    res = _switch(t, handover=False)
    c = t.calls
    assert not res.handover and c.index("verify_images") < c.index("stop_engine") < c.index("restore_tree")
    t = _world()
    t.corrupt_images = CorruptSnapshotError("image pages-4.img fails its checksum")
    with pytest.raises(CorruptSnapshotError, match="fails its checksum") as ei:
        _switch(t, handover=False)
    assert "stop_engine" not in t.calls and "restore_tree" not in t.calls
    assert "nothing was stopped: PID 77 still serves http://127.0.0.1:8101" in ei.value.message
    assert ei.value.details["stopped"] == [] and ei.value.hint  # how to repair a damaged snapshot
    # a hand-over given up for memory at the restore itself (nothing verified yet): checked before the stop
    t = _world()
    offers = iter([t.offer, Offer(10, "MemAvailable 0.00 GiB")])
    t.tools.host.memory_offer = lambda detached=False: next(offers, t.offer)
    res = _switch(t)
    c = t.calls
    assert not res.handover and c.index("take_listener") < c.index("verify_images") < c.index("stop_engine")


def test_nothing_serving_the_port_leaves_the_images_to_the_restore():
    t = FakeWorld(manifest=isolated_manifest())
    res = _switch(t)
    assert res.stopped == [] and "verify_images" not in t.calls and t.calls.count("checksums") == 1
