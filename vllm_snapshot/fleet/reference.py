"""IMAGE references: a registry reference (``HOST[:PORT]/REPO[:TAG|@sha256:HEX]``, the way
podman and oras spell them) or an OCI image-layout directory (``oci:DIR[:TAG]``, skopeo's
spelling). Pure."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError

DEFAULT_TAG = "latest"
#: distribution-spec grammar: repository path components and tags
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPO = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_HOST = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
                   r"|\[[0-9A-Fa-f:]+\])(?::[0-9]{1,5})?$")

FORMS = "HOST[:PORT]/REPO[:TAG|@sha256:DIGEST] or oci:DIR[:TAG]"


@dataclass(frozen=True)
class RegistryRef:
    """A reference into a registry: ``host`` (with ``:port``), ``repo`` (path components),
    and a ``tag`` or a ``digest`` (``sha256:HEX``; then ``tag`` is None)."""

    host: str
    repo: str
    tag: str | None = DEFAULT_TAG
    digest: str | None = None

    @property
    def reference(self) -> str:
        """What goes after ``/manifests/``: the digest when given, else the tag."""
        return self.digest or self.tag or DEFAULT_TAG

    def with_tag(self, tag: str) -> "RegistryRef":
        """The same repository at ``tag``."""
        return RegistryRef(self.host, self.repo, tag, None)

    def __str__(self) -> str:
        return f"{self.host}/{self.repo}" + (f"@{self.digest}" if self.digest else f":{self.tag}")


@dataclass(frozen=True)
class LayoutRef:
    """An OCI image-layout directory ``path`` and the tag (``org.opencontainers.image.ref.name``)
    or digest inside it."""

    path: Path
    tag: str | None = DEFAULT_TAG
    digest: str | None = None

    @property
    def reference(self) -> str:
        return self.digest or self.tag or DEFAULT_TAG

    def with_tag(self, tag: str) -> "LayoutRef":
        return LayoutRef(self.path, tag, None)

    def __str__(self) -> str:
        return f"oci:{self.path}" + (f"@{self.digest}" if self.digest else f":{self.tag}")


Ref = RegistryRef | LayoutRef


def looks_like_image(text: str) -> bool:
    """True when ``text`` is meant as an IMAGE rather than a snapshot name or path: it starts
    with ``oci:`` or its first path component is a host (holds a ``.`` or ``:``, or is
    ``localhost``) and an existing local path does not also carry that name."""
    if text.startswith("oci:"):
        return True
    first, sep, _ = text.partition("/")
    return bool(sep) and (first == "localhost" or "." in first or ":" in first) and not text.startswith((".", "/")) \
        and not Path(text).exists()


def parse(text: str) -> Ref:
    """Parse an IMAGE reference. Raises UsageError naming the accepted forms."""
    if text.startswith("oci:"):
        rest = text[4:]
        digest = tag = None
        if "@" in rest:
            rest, digest = rest.rsplit("@", 1)
            if not _DIGEST.match(digest):
                raise UsageError(f"{text!r}: {digest!r} is not a sha256 digest", hint=f"IMAGE is {FORMS}")
        else:
            head, sep, t = rest.rpartition(":")
            if sep and "/" not in t and _TAG.match(t):
                rest, tag = head, t
        if not rest:
            raise UsageError(f"{text!r} names no directory", hint=f"IMAGE is {FORMS}")
        return LayoutRef(Path(rest), tag if digest is None else None, digest) if (tag or digest) \
            else LayoutRef(Path(rest))
    host, sep, path = text.partition("/")
    if not sep or not _HOST.match(host) or not path:
        raise UsageError(f"{text!r} is not an image reference", hint=f"IMAGE is {FORMS}")
    digest = None
    tag: str | None = DEFAULT_TAG
    if "@" in path:
        path, digest = path.split("@", 1)
        if not _DIGEST.match(digest):
            raise UsageError(f"{text!r}: {digest!r} is not a sha256 digest (sha256: and 64 hex digits)")
        tag = None
    elif ":" in path.rsplit("/", 1)[-1]:
        path, tag = path.rsplit(":", 1)
        if not _TAG.match(tag):
            raise UsageError(f"{text!r}: {tag!r} is not a valid tag (letters, digits, . _ -; at most 128)")
    if not _REPO.match(path):
        raise UsageError(f"{text!r}: repository {path!r} is not valid (lowercase letters, digits, separators . _ - /)",
                         hint=f"IMAGE is {FORMS}")
    return RegistryRef(host, path, tag, digest)
