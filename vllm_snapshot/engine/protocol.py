"""The control channel between the supervisor and the engine root: the single source of its
fd numbers, commands and events (the supervisor, the engine, and the test fake engine all
import from here).

Three pipes, all re-bound by CRIU ``--inherit-fd`` at restore (so they survive the dump); at
dump their identities (``pipe:[inode]``) are recorded per role in the manifest:

* ``control`` (engine fd 0): supervisor -> engine, one JSON command per line.
* ``log``     (engine fds 1 and 2, inherited by EngineCore and workers): engine log text.
* ``events``  (engine fd 3): engine -> supervisor, one JSON event per line.

Commands (``{"cmd": NAME, ...}``):

* ``oracle`` ``[{prompt}]`` -- replay the oracle (with ``prompt``: the same request on that
  prompt, create's rehearsal of the canary record); answered by ``oracle``.
* ``sleep`` ``{level}`` -- reset the prefix cache and sleep; answered by ``slept``.
* ``wake`` -- wake up, reload weights (level 2), reset the prefix cache; answered by ``woken``.
* ``prepare-dump`` -- build the HTTP app, clear the parent-death signal; answered by ``dump-ready``.
* ``attach`` -- first command to a restored tree: die with the supervisor (parent-death signal)
  until ``serve`` decides; answered by ``attached``.
* ``serve`` ``{host, port, die_with_parent, handoff, drain_s}`` -- serve the OpenAI API (the
  engine outlives its supervisor only with ``die_with_parent`` false: ``--detach``); answered
  by ``binding``. SIGTERM/SIGINT then drain: no new connection, requests in flight finish for
  at most ``drain_s`` seconds (default 30), then the engine exits 0; a second signal cuts the
  drain short. The engine lives in a network namespace of its own, so it does not bind
  ``host:port`` itself: the supervisor bound it in the host's namespace and waits on the
  abstract unix socket named ``handoff`` (which it created in the engine's namespace); the
  engine connects there and receives the listening socket (``SCM_RIGHTS``), see
  :mod:`vllm_snapshot.engine.net` and :mod:`vllm_snapshot.supervise.handoff`. Engines of snapshots made
  before that (manifest ``engine.network`` ``host``) get no ``handoff`` and bind themselves.
* ``exit`` -- exit cleanly.

Events (``{"event": NAME, ...}``; each event's fields are :data:`EVENT_FIELDS`, which the
encoder enforces and the supervisor checks on receipt, plus those of :data:`OPTIONAL_FIELDS`):

* ``initialized`` ``{oracle, info[, canary]}`` -- the engine is up; ``info``: kind, vllm, torch,
  served_model_name; ``canary``: the same one-token result for :data:`CANARY_PROMPT`, what the
  HTTP canary of every restore expects (optional: an engine root that does not record it leaves
  the restores' canary on the oracle's prompt).
* ``oracle`` ``{oracle}``, ``slept``, ``woken``, ``attached``.
* ``dump-ready`` ``{modules, sys_path}``: the top-level names of the engine root's
  ``sys.modules`` and its ``sys.path`` (what :mod:`vllm_snapshot.host.codeid` pins).
* ``binding`` ``{address}`` -- the listening socket is bound; the HTTP server starts.
* ``error`` ``{kind, message}`` -- the command failed (``kind`` ``usage``: bad engine args).

EOF on ``control`` before ``serve`` makes the engine exit (its supervisor died); after
``serve`` the engine keeps serving (``--detach``).
"""

from __future__ import annotations

import json
import re

#: The engine root's program, run as ``python -m PROGRAM SPEC_JSON``
#: (:mod:`vllm_snapshot.entrypoints.engine_root`).
PROGRAM = "vllm_snapshot.entrypoints.engine_root"
#: Every name the engine root's program has had on a command line: engines restored from
#: snapshots made before it moved out of ``engine/`` still run as ``vllm_snapshot.engine.main``.
PROGRAMS = (PROGRAM, "vllm_snapshot.engine.main")

FD_CONTROL = 0
FD_LOG = 1
FD_EVENTS = 3
#: role -> the engine's fd number for it (the manifest's ``criu.inherit`` keys are these roles).
ROLES: dict[str, int] = {"control": FD_CONTROL, "log": FD_LOG, "events": FD_EVENTS}

COMMANDS = ("oracle", "sleep", "wake", "prepare-dump", "attach", "serve", "exit")
#: event -> its payload fields (besides ``"event"``), every one always sent: the one table the
#: engine root, the test fake engine (both through :func:`encode_event`) and the supervisor
#: (:func:`missing_fields`) use.
EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    "initialized": ("oracle", "info"),
    "oracle": ("oracle",),
    "slept": (),
    "woken": (),
    "dump-ready": ("modules", "sys_path"),
    "attached": (),
    "binding": ("address",),
    "error": ("kind", "message"),
}
#: event -> the payload fields it may carry besides its :data:`EVENT_FIELDS` (the encoder accepts
#: them, nobody requires them).
OPTIONAL_FIELDS: dict[str, tuple[str, ...]] = {"initialized": ("canary",)}
#: The prompt of the HTTP canary (``initialized``'s ``canary``), a constant. The in-engine oracle
#: already proves the engine computes what create recorded; the canary proves the HTTP path
#: (server, OpenAI serving layer, handed-over socket, tokenizer both ways) answers it, which
#: any prompt does, and a restore pays its prefill: on CPU prefill is compute-bound (the large
#: test model, 2 GiB of float32 weights: 0.48-0.50 s for the 11 tokens of "Once upon a time",
#: 0.16-0.19 s for the 2 of "Hi"), so a short plain one. "Hi" is one ASCII word: a token or two
#: in any tokenizer, nothing a server strips or rejects (an empty prompt is refused). Not part
#: of the snapshot key: the engine behaves the same whatever the prompt; changing it changes
#: only what later creates record.
CANARY_PROMPT = "Hi"
#: The fields of ``initialized``'s ``info``.
INFO_FIELDS = ("kind", "vllm", "torch", "served_model_name", "normalized_args")
EVENTS = tuple(EVENT_FIELDS)


def encode_command(name: str, **kw) -> str:
    """One command line (with ``\\n``). Raises ValueError for a name not in :data:`COMMANDS`."""
    if name not in COMMANDS:
        raise ValueError(f"unknown engine command {name!r}")
    return json.dumps({"cmd": name, **kw}) + "\n"


def encode_event(name: str, **kw) -> str:
    """One event line (with ``\\n``). Raises ValueError for a name not in :data:`EVENTS`, or
    fields other than its :data:`EVENT_FIELDS` (all of them) and :data:`OPTIONAL_FIELDS`
    (``initialized``: its ``info`` other than :data:`INFO_FIELDS`)."""
    if name not in EVENTS:
        raise ValueError(f"unknown engine event {name!r}")
    required, optional = set(EVENT_FIELDS[name]), set(OPTIONAL_FIELDS.get(name, ()))
    if not required <= set(kw) <= required | optional:
        raise ValueError(f"engine event {name!r} takes the fields {list(EVENT_FIELDS[name])}"
                         + (f" (optional: {sorted(optional)})" if optional else "") + f", not {sorted(kw)}")
    if name == "initialized" and (not isinstance(kw["info"], dict) or set(kw["info"]) != set(INFO_FIELDS)):
        raise ValueError(f"the info of engine event 'initialized' takes the fields {list(INFO_FIELDS)}")
    return json.dumps({"event": name, **kw}) + "\n"


def missing_fields(event: dict) -> list[str]:
    """The :data:`EVENT_FIELDS` of a decoded event that it lacks (``[]`` for an unknown event:
    the caller decides about those). Pure."""
    return [f for f in EVENT_FIELDS.get(event.get("event"), ()) if f not in event]


def decode(line: bytes | str) -> dict | None:
    """A command or event dict, or None for a line that is not a JSON object."""
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def drain_line(signal_name: str, busy: int, drain_s: float) -> str:
    """The engine root's line on the first SIGTERM/SIGINT while serving (on its log)."""
    return (f"vllm-snapshot: {signal_name}: draining: no new connections, {busy} request(s) in flight "
            f"may finish for up to {drain_s:g} s")


def cut_line(signal_name: str, busy: int) -> str:
    """The engine root's line on a further signal while it drains (on its log)."""
    return f"vllm-snapshot: {signal_name} again: cancelling {busy} request(s) still in flight"


#: One of :func:`drain_line` / :func:`cut_line` in a log chunk (bytes, a line of its own): what a
#: foreground command that said itself which signal it received and forwarded leaves out.
SIGNAL_LINE = re.compile(rb"^vllm-snapshot: SIG[A-Z0-9]+(?: again)?: (?:draining:|cancelling) [^\n]*\n?", re.M)
