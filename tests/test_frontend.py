"""Front-end options at restore (vllm_snapshot.supervise.frontend): the lexical split and checks run
before CRIU without vLLM, and the order of restore/switch/serve through FakeWorld."""

from __future__ import annotations

import re

from pathlib import Path

import pytest

from vllm_snapshot.supervise import frontend
from vllm_snapshot.engine.args import FRONTEND_OPTIONS, OPTIONS
from vllm_snapshot import ops
from vllm_snapshot.errors import OracleMismatchError, UsageError
from vllm_snapshot.report.progress import Reporter

from fakes import FakeWorld, isolated_manifest
from tls import self_signed


def test_split_keeps_engine_args_and_takes_front_end_options_with_their_values():
    args = ["--dtype", "float32", "--api-key", "k1", "k2", "--max-model-len", "512",
            "--allowed-origins", '["https://a"]', "--allow-credentials", "--root-path=/v", "--served-model-name", "m"]
    front, rest = frontend.split(args)
    assert front == ["--api-key", "k1", "k2", "--allowed-origins", '["https://a"]', "--allow-credentials", "--root-path=/v"]
    assert rest == ["--dtype", "float32", "--max-model-len", "512", "--served-model-name", "m"]


@pytest.mark.parametrize("bad,needle", [
    (["--max-num-seqs", "4"], "frozen in the snapshot"),
    (["--ssl-cert-reqs", "2"], "mutual TLS"),
    (["--middleware", "x.y"], "middleware"),
    (["--port", "9"], "restore's own option"),
    # abbreviations: refused, naming what they could mean (a trial: `--api` was called "frozen")
    (["--api-k", "x"], r"--api-k is an abbreviation, and abbreviations are not accepted here; it could mean --api-key$"),
    (["--api", "x"], r"--api is an abbreviation.*could mean --api-key$"),
    (["--ssl-c=x"], r"could mean --ssl-ca-certs or --ssl-cert-reqs or --ssl-certfile or --ssl-ciphers$"),
    (["--prot", "9"], r"did you mean --port\?"),  # a typo of restore's own option
    (["--detatch"], r"did you mean --detach\?"),
    (["--bogus-flag"], "engine options are frozen"),
])
def test_engine_options_and_unusable_settings_are_refused(bad, needle):
    with pytest.raises(UsageError, match=needle):
        frontend.check(bad, {})


def test_api_key_from_the_environment_unless_given():
    fe = frontend.check([], {"VLLM_API_KEY": "envkey"})
    assert fe.api_keys == ["envkey"] and fe.args == ["--api-key", "envkey"]
    fe = frontend.check(["--api-key", "flagkey"], {"VLLM_API_KEY": "envkey"})
    assert fe.api_keys == ["flagkey"] and "envkey" not in fe.args  # --api-key wins, as for `vllm serve`
    assert all("flagkey" not in d and "envkey" not in d for d in fe.describe())
    assert frontend.check([], {}).api_keys == []


def test_api_key_from_a_systemd_credential(tmp_path: Path):
    (tmp_path / "vllm-api-key").write_text("credkey\n")
    env = {"CREDENTIALS_DIRECTORY": str(tmp_path)}
    assert frontend.check([], env).api_keys == ["credkey"]
    assert frontend.check([], {**env, "VLLM_API_KEY": "envkey"}).api_keys == ["envkey"]
    with pytest.raises(UsageError, match="needs a value"):
        frontend.check(["--api-key="], {})


def test_tls_pair_is_loaded_before_criu(tmp_path: Path):
    cert, key = self_signed(tmp_path)
    fe = frontend.check(["--ssl-keyfile", str(key), f"--ssl-certfile={cert}", "--root-path", "/x"], {})
    assert fe.tls and fe.scheme == "https" and "TLS" in fe.describe()
    assert fe.files == [str(key), str(cert)]  # what the engine user must be able to read
    with pytest.raises(UsageError, match="both --ssl-keyfile and --ssl-certfile"):
        frontend.check(["--ssl-certfile", str(cert)], {})
    with pytest.raises(UsageError, match="no readable file"):
        frontend.check(["--ssl-certfile", str(tmp_path / "nope.pem"), "--ssl-keyfile", str(key)], {})
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    _cert2, key2 = self_signed(other_dir)
    with pytest.raises(UsageError, match="do not load as a TLS key pair"):
        frontend.check(["--ssl-certfile", str(cert), "--ssl-keyfile", str(key2)], {})
    tls = ["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    assert frontend.check(tls + ["--ssl-ciphers", "ECDHE+AESGCM", "--ssl-ca-certs", str(cert)], {}).tls
    with pytest.raises(UsageError, match="selects no cipher"):  # uvicorn's set_ciphers would fail after the bind
        frontend.check(tls + ["--ssl-ciphers", "NOTACIPHER"], {})
    with pytest.raises(UsageError, match="not PEM CA certificates"):
        frontend.check(tls + ["--ssl-ca-certs", str(key)], {})


@pytest.mark.parametrize("bad,needle", [
    (["--allowed-origins", "https://a"], "JSON list of strings"),
    (["--allowed-methods", '{"a": 1}'], "JSON list of strings"),
    (["--uvicorn-log-level", "loud"], "expected one of"),
    (["--h11-max-header-count", "-1"], "positive integer"),
    (["--allow-credentials=yes"], "takes no value"),
])
def test_bad_values_are_refused(bad, needle):
    with pytest.raises(UsageError, match=needle):
        frontend.check(bad, {})


# ------------------------------------------------------------------ order, through FakeWorld

SNAP = Path("/snaps/tiny")


def test_restore_hands_the_options_to_the_engine_and_the_canary_presents_the_key(tmp_path: Path):
    cert, key = self_signed(tmp_path)
    t = FakeWorld(manifest=isolated_manifest())
    t.tools.host.environ = lambda: {"VLLM_API_KEY": "s3cret"}
    req = ops.RestoreRequest(snapshot=SNAP, port=8123,
                             frontend=("--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--uvicorn-log-level", "warning"))
    r, _engine = ops.restore(req, Reporter(), tools=t.tools)
    assert t.served_frontend == ("--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--uvicorn-log-level", "warning",
                                 "--api-key", "s3cret")
    assert t.canary_key == "s3cret" and t.canary_url.startswith("https://")
    assert r.url == "https://127.0.0.1:8123"
    assert "s3cret" not in repr(r.to_json())


def test_bad_front_end_option_refused_before_anything_runs():
    t = FakeWorld(manifest=isolated_manifest())
    with pytest.raises(UsageError):
        ops.restore(ops.RestoreRequest(snapshot=SNAP, port=8123, frontend=("--ssl-certfile", "/nope.pem")), Reporter(), tools=t.tools)
    assert not {"stage_checking", "restore_tree", "port_free"} & set(t.calls)


def test_switch_checks_front_end_options_before_stopping_the_old_engine():
    t = FakeWorld(manifest=isolated_manifest())
    with pytest.raises(UsageError, match="JSON list"):
        ops.switch(SNAP, None, 8123, None, Reporter(), tools=t.tools, frontend=("--allowed-origins", "x"))
    assert "stop_engine" not in t.calls and "restore_tree" not in t.calls


def test_serve_keeps_front_end_options_out_of_the_build_and_applies_them_at_restore(tmp_path: Path):
    t = FakeWorld(manifest=isolated_manifest())
    req = ops.ServeRequest(model="/models/tiny", root=tmp_path, engine_args=["--kv-cache-memory-bytes", "64M"],
                           port=8123, frontend=("--api-key", "k"))
    served, _engine = ops.serve(req, Reporter(), tools=t.tools)
    assert "--api-key" not in t.launch_spec.engine_args and "k" not in t.launch_spec.engine_args
    assert t.served_frontend == ("--api-key", "k") and t.canary_key == "k"


_TABLE_CHECK = r"""
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = make_arg_parser(FlexibleArgumentParser())
by_flag = {f: [a.dest, a.nargs] for a in parser._actions for f in a.option_strings}
ns = parser.parse_args(["--model", "x", "--allowed-origins", '["https://a"]', "--h11-max-header-count", "10"])
print(json.dumps({"flags": by_flag, "origins": ns.allowed_origins, "count": ns.h11_max_header_count}))
"""


@pytest.mark.integration
def test_option_table_matches_vllms_parser():
    """Every flag of FRONTEND_OPTIONS is one vLLM's own `vllm serve` parser knows, with that dest
    and arity; every REFUSED flag exists too (vLLM 0.32). Integration: imports vLLM (~10 s), in a
    child process so that this test session stays free of vLLM's imports."""
    import json
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", _TABLE_CHECK], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    by_flag = got["flags"]
    for flag, (dest, arity) in FRONTEND_OPTIONS.items():
        assert flag in by_flag, f"{flag} is not a vLLM option"
        assert by_flag[flag][0] == dest, flag
        want = {0: 0, 1: None, "+": "+"}[arity]
        assert by_flag[flag][1] == want, f"{flag}: nargs {by_flag[flag][1]!r}"
    for o in OPTIONS:  # the one table: every row's flag, dest and arity
        assert o.flag in by_flag, f"{o.flag} is not a vLLM option"
        assert by_flag[o.flag][0] == o.dest, o.flag
        want = {0: 0, 1: None, "?": "?", "+": "+"}[o.arity]
        assert by_flag[o.flag][1] == want, f"{o.flag}: nargs {by_flag[o.flag][1]!r}"
    # and vLLM types what we pass as text: JSON lists, ints
    assert got["origins"] == ["https://a"] and got["count"] == 10


def test_switch_to_the_serving_snapshot_with_other_front_end_options_restarts_it():
    """A new-user trial rotated the API key with `switch` to the snapshot already serving: it
    said "switched" and kept the old key. The registry keeps a salted digest of the options."""
    from vllm_snapshot.store.registry import Entry

    t = FakeWorld(manifest=isolated_manifest())
    t.tools.host.environ = lambda: {"VLLM_API_KEY": "new"}
    old_fp = frontend.fingerprint(["--api-key", "old"])
    assert frontend.same_settings(["--api-key", "old"], old_fp) and not frontend.same_settings(["--api-key", "new"], old_fp)
    assert "old" not in old_fp
    t.entries = [Entry(snapshot=str(SNAP), pid=77, supervisor_pid=0, host="127.0.0.1", port=8123, started_at=0.0,
                       mode="detached", frontend=old_fp)]
    ops.switch(SNAP, None, 8123, None, Reporter(), tools=t.tools)
    assert "stop_engine" in t.calls and "restore_tree" in t.calls and t.canary_key == "new"
    # the same options again: nothing to do
    t2 = FakeWorld(manifest=isolated_manifest())
    t2.entries = [Entry(snapshot=str(SNAP), pid=77, supervisor_pid=0, host="127.0.0.1", port=8123, started_at=0.0,
                        mode="detached", frontend=frontend.fingerprint(["--uvicorn-log-level", "warning"]))]
    ops.switch(SNAP, None, 8123, None, Reporter(), tools=t2.tools, frontend=("--uvicorn-log-level", "warning"))
    assert "stop_engine" not in t2.calls


@pytest.mark.parametrize("auth,scheme,given,refused", [
    (True, "http", (), "an API key"),
    (False, "https", ("--api-key", "k"), "TLS (https)"),
    (True, "https", (), "an API key and TLS (https)"),
    (True, "http", ("--api-key", "k2"), None),  # a new key: fine
    (False, "http", (), None),
])
def test_switch_refuses_to_drop_the_api_key_or_tls_of_the_engine_it_replaces(tmp_path, auth, scheme, given, refused):
    """A trial switched an engine that required a key over TLS without options: the port then
    served plain HTTP to anyone. The registry records whether a key is required (not the key)."""
    from vllm_snapshot.store.registry import Entry

    t = FakeWorld(manifest=isolated_manifest())
    t.tools.host.environ = lambda: {}
    t.entries = [Entry(snapshot="/snaps/other", pid=77, supervisor_pid=0, host="127.0.0.1", port=8123, started_at=0.0,
                       mode="detached", scheme=scheme, auth=auth)]
    if refused:
        with pytest.raises(UsageError, match=re.escape(f"requires {refused}; the switch would serve without")) as e:
            ops.switch(SNAP, None, 8123, None, Reporter(), tools=t.tools, frontend=given)
        assert "stop --port 8123" in e.value.hint
        assert "stop_engine" not in t.calls and "restore_tree" not in t.calls
    else:
        ops.switch(SNAP, None, 8123, None, Reporter(), tools=t.tools, frontend=given)
        assert "stop_engine" in t.calls and "restore_tree" in t.calls


def test_restore_registers_whether_an_api_key_is_required():
    t = FakeWorld(manifest=isolated_manifest())
    ops.restore(ops.RestoreRequest(snapshot=SNAP, port=8123, frontend=("--api-key", "k")), Reporter(), tools=t.tools)
    ops.restore(ops.RestoreRequest(snapshot=SNAP, port=8124), Reporter(), tools=t.tools)
    assert [(e.port, e.auth) for e in t.registered] == [(8123, True), (8124, False)]
    assert all("k" not in e.frontend for e in t.registered)  # a salted digest, hex


# ------------------------------------------------------------------ switch carries the old engine's options

ORIGINS = '["https://app.example"]'


def _serving(frontend_args, auth=False, snap="/snaps/other"):
    from vllm_snapshot.store.registry import Entry

    return Entry(snapshot=snap, pid=77, supervisor_pid=0, host="127.0.0.1", port=8123, started_at=0.0,
                 mode="detached", auth=auth, frontend_args=frontend_args)


def test_restore_records_its_front_end_options_without_the_api_key():
    t = FakeWorld(manifest=isolated_manifest())
    given = ("--api-key", "k1", "k2", "--allowed-origins", ORIGINS, "--root-path=/api", "--allow-credentials")
    ops.restore(ops.RestoreRequest(snapshot=SNAP, port=8123, frontend=given), Reporter(), tools=t.tools)
    assert t.registered[0].frontend_args == ("--allowed-origins", ORIGINS, "--root-path=/api", "--allow-credentials")
    t.tools.host.environ = lambda: {"VLLM_API_KEY": "k3"}  # the key from the environment is not recorded either
    ops.restore(ops.RestoreRequest(snapshot=SNAP, port=8124), Reporter(), tools=t.tools)
    assert t.registered[1].frontend_args == ()


def test_switch_carries_every_front_end_option_the_old_engine_was_restored_with():
    """A trial: `switch` kept the API key and TLS (it refuses to drop them) but silently served
    without the old engine's --allowed-origins."""
    t = FakeWorld(manifest=isolated_manifest())
    t.tools.host.environ = lambda: {"VLLM_API_KEY": "k"}
    t.entries = [_serving(("--allowed-origins", ORIGINS, "--root-path", "/api", "--enable-log-requests"), auth=True)]
    rep = Reporter()
    ops.switch(SNAP, None, 8123, None, rep, tools=t.tools)
    assert t.served_frontend == ("--allowed-origins", ORIGINS, "--root-path", "/api", "--enable-log-requests",
                                 "--api-key", "k")
    assert t.registered[0].frontend_args == ("--allowed-origins", ORIGINS, "--root-path", "/api", "--enable-log-requests")
    # an option given replaces the old one of the same setting; the others stay
    t2 = FakeWorld(manifest=isolated_manifest())
    t2.tools.host.environ = lambda: {}
    t2.entries = [_serving(("--allowed-origins", ORIGINS, "--allow-credentials", "--root-path", "/api"))]
    ops.switch(SNAP, None, 8123, None, Reporter(), tools=t2.tools,
               frontend=("--allowed-origins", '["https://b.example"]', "--no-allow-credentials"))
    assert t2.served_frontend == ("--root-path", "/api", "--allowed-origins", '["https://b.example"]',
                                  "--no-allow-credentials")


def test_switch_says_which_options_it_kept():
    import io

    out = io.StringIO()
    t = FakeWorld(manifest=isolated_manifest())
    t.tools.host.environ = lambda: {}
    t.entries = [_serving(("--allowed-origins", ORIGINS, "--uvicorn-log-level", "warning"))]
    from vllm_snapshot.report.progress import PlainReporter

    ops.switch(SNAP, None, 8123, None, PlainReporter(stream=out), tools=t.tools, frontend=("--uvicorn-log-level", "info"))
    assert ("keeping the front-end options of the engine on port 8123: --allowed-origins (give one to switch to "
            "change it)") in out.getvalue()


def test_switch_to_the_serving_snapshot_with_its_carried_options_in_another_order_is_nothing_to_do():
    recorded = ("--api-key", "k", "--allowed-origins", ORIGINS)
    t = FakeWorld(manifest=isolated_manifest())
    t.tools.host.environ = lambda: {}
    e = _serving(tuple(frontend.without_secrets(list(recorded))), auth=True, snap=str(SNAP))
    from dataclasses import replace

    t.entries = [replace(e, frontend=frontend.fingerprint(list(recorded)))]
    r = ops.switch(SNAP, None, 8123, None, Reporter(), tools=t.tools, frontend=("--api-key", "k"))
    assert r.unchanged and "stop_engine" not in t.calls
    # a fingerprint an older vllm-snapshot recorded (of the token list itself) still matches
    legacy = frontend._digest("ab" * 8, '["--api-key", "k"]')
    assert frontend.same_settings(["--api-key", "k"], legacy) and not frontend.same_settings(["--api-key", "x"], legacy)


def test_a_rolled_back_engine_gets_its_own_options_back_with_the_switchs_key():
    from vllm_snapshot.errors import CriuError

    for handover in (False, True):
        # stop-then-restore (the old socket cannot be shared): the new engine's CRIU fails;
        # hand-over: the new engine's canary fails after the old one stopped accepting
        t = FakeWorld(manifest=isolated_manifest(), fail={} if handover else {"take_listener": LookupError("none")})
        t.tools.host.environ = lambda: {}
        t.entries = [_serving(("--allowed-origins", ORIGINS,), auth=True)]
        real, served, tries = t.tools.checkpoint.restore_tree, [], []

        def restore_tree(*a, **k):
            tries.append(1)
            if len(tries) == 1 and not handover:
                raise CriuError("CRIU restore failed")
            return real(*a, **k)

        canary = t.tools.engine.http_canary
        t.tools.engine.http_canary = lambda *a: ["token 1 != 2"] if len(tries) == 1 else canary(*a)
        serve = t.tools.engine.serve_engine
        t.tools.checkpoint.restore_tree = restore_tree
        t.tools.engine.serve_engine = lambda *a, **k: (served.append(tuple(k.get("frontend", ()))), serve(*a, **k))[1]
        with pytest.raises(OracleMismatchError if handover else CriuError, match="rolled back"):
            ops.switch(SNAP, None, 8123, None, Reporter(), tools=t.tools,
                       frontend=("--api-key", "k", "--allowed-origins", '["https://b.example"]', "--root-path", "/v2"))
        # the rollback: not the new CORS nor root path
        assert served[-1] == ("--allowed-origins", ORIGINS, "--api-key", "k")
        assert t.registered[-1].frontend_args == ("--allowed-origins", ORIGINS)


def test_an_engine_registered_without_a_record_of_its_options_keeps_the_old_behaviour():
    # registered by an older vllm-snapshot: nothing to carry; the switch's own options only
    t = FakeWorld(manifest=isolated_manifest())
    t.tools.host.environ = lambda: {}
    t.entries = [_serving(None)]
    ops.switch(SNAP, None, 8123, None, Reporter(), tools=t.tools, frontend=("--root-path", "/v"))
    assert t.served_frontend == ("--root-path", "/v")


def test_carry_and_the_secret_split_are_pure_token_operations():
    args = ["--api-key", "a", "b", "--allowed-origins", ORIGINS, "--api-key=c", "--root-path", "/r"]
    assert frontend.without_secrets(args) == ["--allowed-origins", ORIGINS, "--root-path", "/r"]
    assert frontend.secrets(args) == ["--api-key", "a", "b", "--api-key=c"]
    tokens, carried = frontend.carry(["--root-path", "/x"], frontend.without_secrets(args) + ["--from-the-future", "1"])
    assert tokens == ["--allowed-origins", ORIGINS, "--root-path", "/x"] and carried == ["--allowed-origins"]


def test_the_registry_keeps_the_options_where_older_versions_do_not_choke_on_them(tmp_path, monkeypatch):
    import json
    import os
    from dataclasses import fields

    from vllm_snapshot.store import registry
    from vllm_snapshot.store.registry import Entry

    monkeypatch.setenv("VLLM_SNAPSHOT_RUN_DIR", str(tmp_path))
    args = ("--allowed-origins", ORIGINS, "--root-path", "/api")
    f = registry.register(Entry("/snaps/x", os.getpid(), 0, "127.0.0.1", 8101, 0.0, "detached", frontend_args=args))
    raw = json.loads(f.read_text())
    # what an older vllm-snapshot reads: Entry(**raw) with its own fields (one that knew no
    # drain file removed an entry with a field it did not know)
    assert set(raw) <= {x.name for x in fields(Entry)} - {"drain_s", "frontend_args"}
    assert json.loads(f.with_suffix(".frontend").read_text()) == list(args)
    assert oct(f.with_suffix(".frontend").stat().st_mode & 0o777) == "0o600"
    assert [e.frontend_args for e in registry.entries()] == [args]
    # no record (an engine an older version registered), or a broken one: None, the engine is kept
    f.with_suffix(".frontend").write_text('{"not": "a list"}')
    assert [e.frontend_args for e in registry.entries()] == [None]
    f.with_suffix(".frontend").unlink()
    assert [e.frontend_args for e in registry.entries()] == [None]
    # removed by an older version (the .json only): the options file goes with the next read
    registry.register(Entry("/snaps/x", os.getpid(), 0, "127.0.0.1", 8101, 0.0, "detached", frontend_args=()))
    f.unlink()
    assert registry.entries() == [] and not list((tmp_path / "engines").iterdir())
