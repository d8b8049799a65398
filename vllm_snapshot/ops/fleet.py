"""push / pull / inspect IMAGE: the sequencing (docs/oci-format.md is the format).

push: trust checks, manifest, layout (``open_snapshot``) -> create scrubbed the environment
-> every image checksum, the weights file (stat-pinned) -> layers (the weights file's too),
config, manifest last (+ signature).

pull: the artifact's manifest -> compatibility from its annotations alone (host class fields,
engine user, external mounts, the model at its path with the same bytes): a refusal before any
blob -> signature (``--verify-key``) -> per-name lock, staging dir beside the store -> config
(the snapshot manifest; must agree with the annotations) -> layers in parallel, digests
checked while streaming -> the weights file (a CPU snapshot's; fleet/weights.py): nothing when
the node has it at its recorded path, else linked from the store's ``.weights`` or downloaded
into a locked staging dir beside that path -> the snapshot's own checksums and code table
digest -> the weights file renamed into place (its BLAKE3 checked) -> manifest last,
``pulled.json`` (where from), publish by rename. Nothing half-pulled is listed or restorable,
and nothing but a complete, verified weights file is ever at the recorded path.
The staging dir is the store's partial dir of that artifact (``.pull-HEX``, fleet/partial.py):
an interrupted pull (a signal, a registry or network failure) leaves the layers it verified
there and the next pull of the same artifact downloads only the rest; a failed verification
removes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import (CorruptSnapshotError, EnvironmentProblem, IncompatibleHostError, ModelChangedError, UsageError,
                      Interrupted, from_os_error, q)
from .. import units
from ..fleet import oci, partial, reference, sign, transfer
from ..fleet.transport import Net, NotFound, Target
from ..effects.tools import Tools
from ..report.results import ImageInspected, Pulled, Pushed


@dataclass(frozen=True)
class PushRequest:
    """``snapshot`` (a dir), ``image`` (IMAGE text), ``plain_http``, ``sign_key`` (PEM path),
    ``chunk_bytes``: upload in PATCH chunks of this size (0: one PUT per blob; None: the
    environment's, :class:`~vllm_snapshot.fleet.transport.Net`)."""

    snapshot: Path
    image: str
    plain_http: bool = False
    sign_key: Path | None = None
    chunk_bytes: int | None = None


@dataclass(frozen=True)
class PullRequest:
    """``image`` (IMAGE text), ``root`` (the store), ``name`` (default: the repository's last
    component and the tag), ``plain_http``, ``verify_key`` (PEM public key path)."""

    image: str
    root: Path
    name: str | None = None
    plain_http: bool = False
    verify_key: Path | None = None


def _tag_of(ref: reference.Ref, verb: str) -> str:
    if ref.digest:
        raise UsageError(f"{verb} needs a tag, not a digest: {ref}", hint="write IMAGE as ...:TAG")
    return ref.tag or reference.DEFAULT_TAG


def _abandon(target) -> list:
    """After a failed push: what ``target`` removes of what it made for this push (an image
    layout it created; a registry: nothing). Never raises."""
    abandon = getattr(target, "abandon", None)
    return abandon() if abandon is not None else []


def push(req: PushRequest, rep, t: Tools) -> Pushed:
    """Push snapshot ``req.snapshot`` to ``req.image`` (with the weights file it references, as
    layers of their own). Raises UsageError (bad IMAGE, a snapshot whose create did not scrub
    the environment, bad key), CorruptSnapshotError (the snapshot's own checks),
    ModelChangedError (its weights file is missing or changed), EnvironmentProblem (registry)."""
    from ..store.snapkey import model_part

    ref = reference.parse(req.image)
    tag = _tag_of(ref, "push")
    key = sign.load_private(req.sign_key) if req.sign_key is not None else None
    again = shlex.join(["vllm-snapshot", "push", str(req.snapshot), str(ref.with_tag(tag))]
                       + (["--plain-http"] if req.plain_http else [])
                       + (["--sign-key", str(req.sign_key)] if req.sign_key is not None else []))
    # the destination before the seconds of checksumming: a file, or a folder that is neither
    # empty nor a layout, is refused here with nothing written (a layout is made on its first blob)
    target = t.fleet.open_target(ref, req.plain_http, True)
    if req.chunk_bytes is not None and isinstance(getattr(target, "net", None), Net):
        target.net = dataclasses.replace(target.net, chunk_bytes=req.chunk_bytes)
    snapshot = t.store.canonical(req.snapshot)
    with t.store.snapshot_lock(snapshot, shared=True):
        m = t.files.open_snapshot(snapshot)
        if not getattr(m.engine, "env_scrubbed", False):
            raise UsageError(
                f"{snapshot} was not made from a scrubbed environment (its create kept variables with --keep-env, or "
                "predates that record); its images may hold them, so it is not pushed",
                hint="create it again without --keep-env of secret variables, then push")
        with rep.phase("verify", "checking every image checksum"):
            t.files.verify_images(snapshot, m)
            # the weights file it references travels as its own layers: it must be the one
            # create wrote (stat-pinned; re-hashed when the stat changed), else exit 4
            t.files.check_weights(m)
        config = t.fleet.snapshot_config(snapshot)
        with rep.phase("push", f"pushing to {ref}"):
            try:
                r = transfer.push(snapshot, config, oci.annotations(m, model_part(m.model.files)), target, tag,
                                  signing_key=key, docker_reference=str(ref.with_tag(tag)).removesuffix(f":{tag}"),
                                  weights=m.weights)
            except BaseException as e:  # nothing was tagged: a layout this push began goes
                removed = _abandon(target)
                if isinstance(e, OSError) and e.filename is None and getattr(target, "path", None) is not None:
                    e = OSError(e.errno, e.strerror, str(target.path))  # a write(2) names no file: the layout's
                host = from_os_error(e) if isinstance(e, OSError) else None
                if host is not None:  # the local side: an oci:DIR's filesystem (full, read-only, ...)
                    raise EnvironmentProblem(
                        f"push to {target.describe()} failed: {host.message}; "
                        + ("nothing was published: the layout it had begun there was removed" if removed
                           else "blobs it wrote are kept (the next push reuses them)"),
                        hint=host.hint, details=host.details) from e
                if not isinstance(e, EnvironmentProblem):
                    raise
                # the network or the registry, past the retries
                e.hint = (f"{e.hint}; " if e.hint else "") + (
                    f"then `{again}` pushes again, sending only the blobs {target.describe()} lacks (the tag is set "
                    "last: it still names what it named before)")
                raise
    notes = list(r.notes)
    if r.repaired:
        notes.append(f"{len(r.repaired)} blob(s) {target.describe()} held damaged (not matching their digest) were "
                     f"written again: {', '.join(r.repaired[:3])}" + (" ..." if len(r.repaired) > 3 else ""))
    return Pushed(snapshot=str(snapshot), image=str(ref.with_tag(tag)), digest=r.digest, bytes=r.bytes,
                  sent_bytes=r.sent_bytes, blobs=r.blobs, skipped=r.skipped, seconds=round(r.seconds, 3),
                  signature=r.signature_tag, repaired=list(r.repaired), warnings=notes)


def fetch(ref: reference.Ref, plain_http: bool, t: Tools) -> tuple[Target, oci.Artifact]:
    """The target and artifact manifest of ``ref``. Raises UsageError (no such image)."""
    target = t.fleet.open_target(ref, plain_http, False)
    try:
        return target, transfer.fetch_manifest(target, ref.reference, str(ref))
    except NotFound as e:
        raise UsageError(f"{ref}: no such image ({e})", hint="check the repository and tag (`vllm-snapshot push` "
                                                             "writes them)") from e


def compatibility(f: oci.Facts, t: Tools, where: str) -> None:
    """Refuse, from the annotations alone, a node that does not fit: host class fields (each
    expected vs here), engine user, external mounts, a weights file that cannot be placed at its
    recorded path (IncompatibleHostError, exit 3); the model missing at its path or other bytes
    there (ModelChangedError, exit 4, naming the path)."""
    from ..host import identity
    from ..store.snapkey import model_part

    here = {k: v for k, v in t.host.host_identity(f.kind).items() if k not in oci.MACHINE_FIELDS}
    diffs = identity.compare(f.host_class, here)
    problems = [str(d).replace("snapshot has", "artifact has") for d in diffs]
    if f.user is not None:
        problems += [f"engine user: {p}" for p in t.host.user_problems(f.user)]
    problems += [f"mount: {p}" for p in t.host.check_external_mounts(f.mounts)]
    if f.machine.get("gpu_uuid_used") and f.machine["gpu_uuid_used"] not in t.host.gpu_uuids():
        # as restore places it: the recorded GPU, else its model at its minor
        from ..checkpoint import gpu

        try:
            gpu.place(f.machine, t.host.gpu_slots())
        except IncompatibleHostError as e:
            problems.append(f"GPU: {e.message}")
    if problems:
        raise IncompatibleHostError(
            f"{where} does not fit this node (nothing was downloaded):\n  " + "\n  ".join(problems),
            hint="pull it on a node of the class it was built on, or build the snapshot on this node",
            details={"fields": [d.__dict__ for d in diffs], "problems": problems})
    path = Path(f.model_path)
    if not t.host.path_exists(path):
        raise ModelChangedError(f"{where} needs the model at {path}, which this node lacks (nothing was downloaded)",
                                hint=f"put the same model files at {path}, then pull again")
    files = t.model.digest_model(path)
    if model_part(files) != f.model_digest:
        raise ModelChangedError(f"{where} needs other model bytes at {path} than this node holds there "
                                "(nothing was downloaded)",
                                hint=f"put the model the snapshot was made from at {path} (`vllm-snapshot inspect "
                                     f"{q(where)}` shows its digest), then pull again")
    if f.weights_path is not None:
        wp = Path(f.weights_path)
        why = t.fleet.weights_problem(wp)
        if why is not None and not t.fleet.weights_present(wp, f.weights_blake3, f.weights_bytes):
            from ..fleet.weights import refusal

            raise refusal(wp, why, where)


def default_name(ref: reference.Ref) -> str:
    """The store name of a pull without ``--name``: the repository's (or layout dir's) last
    component, then the tag or the digest's first 12 hex digits."""
    base = ref.repo.rsplit("/", 1)[-1] if isinstance(ref, reference.RegistryRef) else (ref.path.name or "oci")
    suffix = ref.digest.split(":", 1)[1][:12] if ref.digest else (ref.tag or reference.DEFAULT_TAG)
    return f"{base}-{suffix}"


def held(root: Path, digest: str, prefer: str | None, t: Tools) -> Path | None:
    """The snapshot under ``root`` whose pull record names the artifact manifest ``digest``
    (``sha256:HEX``) and that no restore refused since (``list`` shows it ✗): ``root/prefer``
    when it is one, else the first by name; None when there is none. Reads only."""
    from ..errors import SnapshotError

    if not t.host.path_exists(root):
        return None
    found = []
    for p in t.store.list_snapshots(root):
        try:
            rec = t.files.pulled_from(p)
        except SnapshotError:
            continue  # a record that is not one: `list` shows it; never reused
        if rec is not None and rec.get("digest") == digest and t.store.refusal(p) is None:
            found.append(p)
    if not found:
        return None
    return next((p for p in found if p.name == prefer), sorted(found)[0])


def _taken(dest: Path, name: str, ref: reference.Ref, digest: str, t: Tools) -> UsageError:
    """The refusal of a pull whose store name ``dest`` exists, saying what it holds."""
    from ..errors import SnapshotError

    try:
        rec = t.files.pulled_from(dest)
    except SnapshotError:
        rec = None
    ways = f"pull it under another name (--name NAME), or delete {name} (`vllm-snapshot delete {q(name)}`) and pull again"
    if rec is not None and rec.get("digest") == digest:
        why = (t.store.refusal(dest) or {}).get("reason", "see `vllm-snapshot list`")
        return UsageError(f"{dest} holds this artifact ({digest}) but a restore refused it ({why}); nothing was "
                          "pulled", hint=ways)
    if rec is not None and rec.get("image") == str(ref):
        return UsageError(f"{dest} was pulled from {ref} when that tag named {rec.get('digest')}; the tag now names "
                          f"another artifact ({rec.get('digest')} -> {digest}); nothing was pulled", hint=ways)
    origin = f"pulled from {rec.get('image')} ({rec.get('digest')})" if rec is not None else "made on this node"
    return UsageError(f"{dest} already exists ({origin}, not {ref} {digest}); nothing was pulled", hint=ways)


def pull(req: PullRequest, rep, t: Tools) -> Pulled:
    """Pull ``req.image`` into the store ``req.root`` (see the module doc for the order).
    When the store already holds that artifact (a snapshot whose pull record has the same
    manifest digest and that no restore refused: :func:`held`; without ``--name`` any such,
    with it only that name), that snapshot is the result and nothing is downloaded
    (``Pulled.already``; its signature checked again with ``req.verify_key``; restore verifies
    its checksums as always). Without ``--name``, when the default name (:func:`default_name`)
    holds another artifact (the tag moved since), it is pulled as ``NAME-DIGEST12`` beside it
    (a warning says so; the old copy is kept). Raises UsageError (``--name`` exists holding
    something else: the message says what it holds and, after a tag moved, the digest before
    -> now),
    IncompatibleHostError, ModelChangedError, UntrustedArtifactError (``--verify-key``),
    CorruptSnapshotError, EnvironmentProblem, BusyError; publishes nothing on any of them."""
    from ..store import checksums, manifest, store
    from ..store.snapkey import model_part

    ref = reference.parse(req.image)
    name = req.name or default_name(ref)
    if not store.valid_name(name):
        raise UsageError(f"{name!r} is not a valid snapshot name ({store.NAME_RULE})", hint="pass --name NAME")
    pub = sign.load_public(req.verify_key) if req.verify_key is not None else None
    t0 = t.clock.monotonic()
    with rep.phase("manifest", f"reading {ref}"):
        target, art = fetch(ref, req.plain_http, t)
        f = oci.facts(art.annotations, str(ref))
    have = held(req.root, art.digest, name, t)
    if have is not None and (req.name is None or have.name == req.name):
        verified_by = None
        if pub is not None:
            with rep.phase("signature", "verifying the signature"):
                verified_by = transfer.verify_signature(target, art, pub, str(ref))
        return Pulled(snapshot=str(have), image=str(ref), digest=art.digest, bytes=art.blob_bytes,
                      seconds=round(t.clock.monotonic() - t0, 3), verified_by=verified_by, already=True)
    notes = []
    if req.name is None and t.host.path_exists(req.root / name):
        # the default name holds another artifact (the tag moved since, or another image's):
        # this one goes beside it, named by its digest; the old copy is left as it is
        was = name
        name = f"{name}-{art.digest.split(':', 1)[1][:12]}"
        notes.append(f"{was} holds another artifact than {ref} names now ({art.digest}); pulling it as {name} "
                     f"(delete {was} when nothing restores it any more)")
    with rep.phase("fit", "checking this node fits (host class, user, mounts, model)"):
        compatibility(f, t, str(ref))
    verified_by = None
    if pub is not None:
        with rep.phase("signature", "verifying the signature"):
            verified_by = transfer.verify_signature(target, art, pub, str(ref))
    store.ensure_root(req.root)
    dest = t.store.canonical(req.root / name)
    with t.store.snapshot_lock(dest, shared=False, must_exist=False):
        if t.host.path_exists(dest):
            raise _taken(dest, name, ref, art.digest, t)
        report = t.store.reclaim(dest.parent)
        with t.fleet.pull_staging(dest, art.digest) as st, _explained(req, ref, name, st), \
                contextlib.ExitStack() as stack:
            # (the staging dir resumes what a killed pull of this artifact left)
            staging = st.path
            report += st.removed
            config = transfer.fetch_bytes(target, art.config_digest, art.config_size, "config (snapshot manifest)")
            try:
                m = manifest.parse(config.decode("utf-8"), f"{ref} config")
            except UnicodeDecodeError as e:
                raise CorruptSnapshotError(f"{ref}: the config is not UTF-8 text") from e
            if m.weights is not None and not art.weights:
                raise CorruptSnapshotError(f"{ref}: the snapshot references the weights file {m.weights.path}, which "
                                           "the artifact does not hold (pushed by a vllm-snapshot that did not carry "
                                           "weights files); nothing was pulled",
                                           hint="push the snapshot again with this version of `vllm-snapshot push`")
            said = oci.annotations(m, model_part(m.model.files))
            wrong = sorted(k for k, v in said.items() if art.annotations.get(k) != v)
            if wrong:
                raise CorruptSnapshotError(f"{ref}: the manifest annotations disagree with the snapshot manifest "
                                           f"({', '.join(wrong[:5])}); nothing was pulled",
                                           hint="push the snapshot again with `vllm-snapshot push`")
            # the snapshot's BLAKE3 pass over its uncompressed files runs while they are written:
            # each file hashed from disk in order, as far as its verified layers reach
            assembled = checksums.Assembling(_plain_members(staging, m))
            stack.callback(assembled.cancel)
            with rep.phase("download", f"downloading {(art.blob_bytes - art.weights_bytes) / 1e6:.0f} MB"):
                got = transfer.download(target, art, staging, resumable=st.resumable,
                                        on_blob=lambda p: assembled.ready(staging / p.member, p.offset, p.size))
            with contextlib.ExitStack() as placing:
                wgot, how, ws = _stage_weights(target, art, m, req.root, str(ref), rep, t, placing)
                if ws is not None:
                    report += ws.removed
                with rep.phase("verify", "checking the snapshot's own checksums"):
                    t.fleet.check_pulled(staging, m, assembled)
                if ws is not None:  # the weights file last but one: complete and verified, then the snapshot
                    ws.place()
                here = t.host.host_identity(m.engine.kind)
                t.fleet.publish_pulled(staging, dest, config, {
                    "image": str(ref), "digest": art.digest,
                    "pulled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t.clock.now())),
                    "machine_id": here.get("machine_id", "unknown"), "hostname": here.get("hostname", "unknown"),
                    "verified_by": verified_by})
    wskip = art.weights_bytes if how in ("present", "linked") else wgot.reused_bytes
    notes += list(getattr(target, "notes", ()))
    return Pulled(snapshot=str(dest), image=str(ref), digest=art.digest, bytes=art.blob_bytes,
                  seconds=round(t.clock.monotonic() - t0, 3), verified_by=verified_by,
                  fetched_bytes=got.fetched_bytes + wgot.fetched_bytes,
                  reused_blobs=got.reused + (len(art.weights) if how in ("present", "linked") else wgot.reused),
                  reused_bytes=got.reused_bytes + wskip,
                  warnings=notes + [f"removed leftover {p}" for p in report],
                  weights=m.weights.path if m.weights is not None else None,
                  weights_bytes=art.weights_bytes, weights_fetched_bytes=wgot.fetched_bytes, weights_reused=how)


def resume_command(req: PullRequest, name: str) -> str:
    """The command line that pulls ``req.image`` again into the same store and name -- and so
    continues from the partial directory a failed pull of it left."""
    argv = ["vllm-snapshot", "--root", str(req.root), "pull", req.image, "--name", name]
    if req.plain_http:
        argv.append("--plain-http")
    if req.verify_key is not None:
        argv += ["--verify-key", str(req.verify_key)]
    return shlex.join(argv)


def repair_hint(ref: reference.Ref, digest: str, missing: bool, plain_http: bool) -> str:
    """What repairs an artifact whose blob ``digest`` a pull found ``missing`` or damaged, as
    commands that work (docs/oci-format.md, "A damaged artifact"). ``SNAPSHOT`` in them is the
    snapshot it was pushed from, on the node that holds it."""
    image = str(ref.with_tag(ref.tag or "TAG"))
    flags = " --plain-http" if plain_http and isinstance(ref, reference.RegistryRef) else ""
    push = f"`vllm-snapshot push SNAPSHOT {q(image)}{flags}`"
    if missing:
        return (f"on the node that holds the snapshot, {push} uploads the missing blob (SNAPSHOT: the snapshot it was "
                "pushed from), then pull again")
    if isinstance(ref, reference.LayoutRef):
        return (f"on the node that holds the snapshot, {push} writes it again (push hashes every blob a layout "
                "already holds and replaces one that does not match its digest; SNAPSHOT: the snapshot it was pushed "
                "from), then pull again")
    hx = digest.split(":", 1)[1]
    return (f"{ref.host} serves damaged bytes for blob {digest}, and pushing the same blob again does not replace "
            "them (a registry keeps what it holds under a digest; distribution 2.8 keeps it even after a DELETE "
            "through its API, and shares it between repositories). On the registry's host remove the blob's data "
            f"(distribution's filesystem storage: `rm -r ROOTDIR/docker/registry/v2/blobs/sha256/{hx[:2]}/{hx}`, "
            "ROOTDIR its storage.filesystem.rootdirectory; restart it when it caches blob descriptors), then run "
            f"{push} on the node that holds the snapshot (SNAPSHOT: the snapshot it was pushed from) and pull again; "
            "or push the snapshot to another registry, or to an image layout (`vllm-snapshot push SNAPSHOT "
            "oci:DIR:TAG`), and pull from there")


@contextlib.contextmanager
def _explained(req: PullRequest, ref: reference.Ref, name: str, st):
    """Inside a pull's staging: a network/registry failure (past the retries) says that the
    verified layers are kept and which command resumes; a damaged or missing blob says what
    repairs it (:func:`repair_hint`)."""
    try:
        yield
    except Interrupted as e:  # kept for resuming (fleet/partial.py): say what, where, and how to drop it
        if not st.resumable or not Path(st.path).is_dir():
            raise
        size = partial.disk_bytes(st.path)
        raise Interrupted(
            f"{e.message}, except the partial pull {st.path} ({units.human_bytes(size)}: the layers verified so far), "
            "kept on purpose so that the same pull resumes from it",
            hint=f"`{resume_command(req, name)}` resumes the pull; `rm -r {q(st.path)}` removes it (the next pull of "
                 f"another image into this store, or any pull after {partial.MAX_AGE_S / 3600:g} h, removes it too)",
            details={**(e.details if isinstance(e.details, dict) else {}), "kept": str(st.path), "kept_bytes": size}) from e
    except EnvironmentProblem as e:
        kept = (f"the layers verified so far are kept in {st.path}, and " if st.resumable else "")
        e.hint = (f"{e.hint}; " if e.hint else "") + f"{kept}`{resume_command(req, name)}` resumes the pull"
        raise
    except CorruptSnapshotError as e:
        d = e.details if isinstance(e.details, dict) else {}
        if d.get("blob"):
            e.hint = repair_hint(ref, d["blob"], bool(d.get("missing")), req.plain_http)
        raise


def _plain_members(staging: Path, m) -> dict:
    """The uncompressed files of snapshot manifest ``m`` as they are laid out in ``staging``
    (path -> :class:`~vllm_snapshot.store.manifest.ImageFile`): those whose BLAKE3 is of the
    stored bytes, so it can be computed as a pull writes them."""
    from ..store import archive, layout

    sd = layout.SnapshotDir(staging)
    groups = [(sd.images, m.images), (sd.files, m.extra_files)]
    if m.carried is not None:
        groups.append((sd.carried, m.carried.blobs))
    return {d / archive.stored_name(i): i for d, images in groups for i in images if i.compression == "none"}


def _stage_weights(target: Target, art: oci.Artifact, m, root: Path, where: str, rep, t: Tools,
                   stack: contextlib.ExitStack):
    """The weights file of a pull (``m.weights``; none: nothing to do): (bytes downloaded as
    :class:`~vllm_snapshot.fleet.transfer.Downloaded`, how it was had -- ``present`` / ``linked``
    / ``resumed`` / None for downloaded whole or no file --, the entered
    :class:`~vllm_snapshot.fleet.weights.WeightsStaging` whose ``place()`` the caller calls, or
    None when nothing is to be placed). A file already at the recorded path with the recorded
    BLAKE3 is used as it is (nothing fetched); else one of that BLAKE3 in ``root/.weights`` is
    hard-linked; else the layers are downloaded (resumable). Raises CorruptSnapshotError (a
    layer's sha256), IncompatibleHostError (the directory cannot be made), EnvironmentProblem."""
    from ..store import weights as sw

    none = transfer.Downloaded(0, 0, 0, 0)
    if m.weights is None:
        return none, None, None
    final, b3, size = Path(m.weights.path), m.weights.blake3, m.weights.size
    with rep.phase("weights", f"checking for the weights file {final}"):
        if t.fleet.weights_present(final, b3, size):
            return none, "present", None
    ws = stack.enter_context(t.fleet.weights_staging(final, b3, where))  # waits for a pull of the same file
    if t.fleet.weights_present(final, b3, size):  # placed by a pull we waited for
        return none, "present", None
    local = sw.path_of(root, b3)
    if local != final and t.fleet.weights_present(local, b3, size) and ws.link_from(local):
        return none, "linked", ws
    with rep.phase("download", f"downloading the weights file ({art.weights_bytes / 1e6:.0f} MB)"):
        got = transfer.download_weights(target, art, ws.dir)
    return got, "resumed" if got.reused_bytes else None, ws


def ensure_pulled(req: PullRequest, rep, t: Tools) -> Path:
    """``restore IMAGE``: the store's snapshot of ``req.image``: one that holds the same
    artifact (:func:`held`, the default name first) is used as it is (its signature checked
    again with ``req.verify_key``; the restore verifies it as always), else it is pulled as
    :func:`pull` names it (the default name, or ``NAME-DIGEST12`` when that holds another
    artifact). Says which snapshot it uses (``rep.info``). Raises what :func:`pull` raises."""
    r = pull(req, rep, t)
    for w in r.warnings:
        rep.info(f"note: {w}")
    rep.info(f"{r.image} ({r.digest}) is " + (f"already in the store as {Path(r.snapshot).name}: nothing downloaded"
                                              if r.already else f"pulled as {Path(r.snapshot).name}"))
    return Path(r.snapshot)


def inspect_image(image: str, plain_http: bool, t: Tools) -> ImageInspected:
    """Read only the manifest of ``image``. Raises UsageError, CorruptSnapshotError."""
    ref = reference.parse(image)
    _, art = fetch(ref, plain_http, t)
    oci.facts(art.annotations, str(ref))
    w = None
    if art.weights:
        w = {"path": art.weights[0].weights_path, "blake3": art.weights[0].weights_blake3,
             "bytes": art.weights_bytes, "layers": len(art.weights), "media_type": oci.WEIGHTS_TYPE,
             "digests": [p.digest for p in art.weights]}
    return ImageInspected(image=str(ref), digest=art.digest, blobs=len(art.parts) + len(art.weights),
                          bytes=art.blob_bytes, annotations=art.annotations, weights=w)


class RegistryCache:
    """``serve --registry REPO``: the repository as a cache of snapshots keyed by the snapshot
    key (the tag). ``repo`` is ``HOST[:PORT]/REPO`` or ``oci:DIR`` (no tag); ``tools`` has the
    snapshot and fleet roles; ``sign_key``/``verify_key`` as for push/pull."""

    def __init__(self, repo: str, tools: Tools, rep, plain_http: bool = False, sign_key: Path | None = None,
                 verify_key: Path | None = None):
        ref = reference.parse(repo)
        if ref.digest is not None or (isinstance(ref, reference.RegistryRef) and ":" in repo.rsplit("/", 1)[-1]) \
                or (isinstance(ref, reference.LayoutRef) and ref.tag != reference.DEFAULT_TAG):
            raise UsageError(f"--registry {repo!r} names a tag or digest; give the repository only",
                             hint="serve tags each snapshot with its key")
        if isinstance(ref, reference.RegistryRef):
            Net.from_env()  # a bad VLLM_SNAPSHOT_NET_* is a usage error now, not a warning after the build
        self.repo, self.t, self.rep = repo, tools, rep
        self.plain_http, self.sign_key, self.verify_key = plain_http, sign_key, verify_key
        #: seconds of the last :meth:`offer`'s push (None: nothing pushed)
        self.push_s: float | None = None

    def image(self, key: str) -> str:
        """The IMAGE of the snapshot of ``key``."""
        return f"{self.repo}:{key}"

    def has(self, key: str) -> bool:
        """True when the repository holds a complete artifact tagged ``key``."""
        ref = reference.parse(self.image(key))
        try:
            fetch(ref, self.plain_http, self.t)
        except UsageError:
            return False
        return True

    def fetch(self, key: str, target: Path) -> Path | None:
        """Pull the snapshot of ``key`` as ``target`` (in the store ``target.parent``); None when
        the repository has none. Raises what :func:`pull` raises (a node that does not fit:
        IncompatibleHostError / ModelChangedError, before any blob)."""
        if not self.has(key):
            return None
        r = pull(PullRequest(self.image(key), target.parent, target.name, self.plain_http, self.verify_key),
                 self.rep, self.t)
        return Path(r.snapshot)

    def offer(self, snapshot: Path, key: str, serving: str | None = None) -> list[str]:
        """Push ``snapshot`` under ``key`` unless the repository has that tag already (two nodes
        building one key at once: both push complete artifacts, the manifest last, so the tag
        always names a complete one). The push runs in this process, after the engine serves
        at ``serving`` (a URL, said before the push starts: the command returns when the push
        is done; ``push_s`` its seconds). Returns warnings (a push that failed: serving goes on)."""
        from ..errors import SnapshotError

        start = None
        try:
            if self.has(key):
                return []
            self.rep.info((f"serving on {serving}; " if serving else "")
                          + f"pushing to {self.repo} (the engine serves meanwhile)")
            start = self.t.clock.monotonic()
            r = push(PushRequest(snapshot, self.image(key), self.plain_http, self.sign_key), self.rep, self.t)
        except SnapshotError as e:
            return [f"not pushed to {self.repo}: {e.message}"]
        finally:
            if start is not None:
                self.push_s = round(self.t.clock.monotonic() - start, 3)
        self.rep.info(f"pushed {snapshot.name} to {r.image} ({r.digest}) in {self.push_s:.2f} s")
        return []
