"""Signatures in cosign's layout, made offline with a local key (docs/oci-format.md,
"Signatures").

The signature of artifact ``sha256:HEX`` is an OCI image manifest tagged ``sha256-HEX.sig`` in
the same repository (cosign's tag convention: no referrers API needed, distribution 2.8 has
none). Its one layer (media type :data:`PAYLOAD_TYPE`) is cosign's "simple signing" payload
naming the artifact's manifest digest; the layer's annotation :data:`A_SIGNATURE` is the
base64 ECDSA P-256 / SHA-256 signature (ASN.1 DER) of the payload bytes. So ``cosign verify
--key KEY.pub --insecure-ignore-tlog IMAGE`` (and a containers-policy ``sigstoreSigned`` rule
with ``keyPath``) verify what ``push --sign-key`` made, and ``pull --verify-key`` verifies what
``cosign sign --key`` made with a P-256 key.

Keys: PEM. Private: PKCS#8 or SEC1 EC P-256 (``openssl ecparam -name prime256v1 -genkey
-noout -out KEY``), encrypted ones with the password in ``$VLLM_SNAPSHOT_SIGN_PASSWORD``;
public: SubjectPublicKeyInfo PEM (``openssl ec -in KEY -pubout``, or cosign's ``cosign.pub``).
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

from ..errors import UntrustedArtifactError, UsageError
from . import oci

PAYLOAD_TYPE = "application/vnd.dev.cosign.simplesigning.v1+json"
A_SIGNATURE = "dev.cosignproject.cosign/signature"
SIG_CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
PASSWORD_ENV = "VLLM_SNAPSHOT_SIGN_PASSWORD"


class SignatureError(UntrustedArtifactError):
    """The artifact is unsigned, or no signature verifies with the given key (exit 13,
    ``untrusted-artifact``: a trust refusal, not corruption)."""


def sig_tag(digest: str) -> str:
    """cosign's signature tag for manifest ``digest`` (``sha256:HEX`` -> ``sha256-HEX.sig``)."""
    return digest.replace(":", "-") + ".sig"


def payload(docker_reference: str, digest: str) -> bytes:
    """cosign's simple-signing payload for ``digest`` (canonical JSON bytes)."""
    return json.dumps({"critical": {"identity": {"docker-reference": docker_reference},
                                    "image": {"docker-manifest-digest": digest},
                                    "type": "cosign container image signature"},
                       "optional": None}, separators=(",", ":")).encode()


def load_private(path: Path):
    """The EC P-256 private key in PEM file ``path``. Raises UsageError saying what is wrong."""
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read the signing key {path}: {e.strerror}") from e
    pw = os.environ.get(PASSWORD_ENV)
    try:
        key = load_pem_private_key(data, password=pw.encode() if pw else None)
    except (ValueError, TypeError) as e:
        raise UsageError(f"{path} is not a PEM EC private key this tool can read ({e})",
                         hint="make one with `openssl ecparam -name prime256v1 -genkey -noout -out KEY`; for an "
                              f"encrypted key set {PASSWORD_ENV}") from e
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
        raise UsageError(f"{path} is not an EC P-256 key (cosign's kind)",
                         hint="make one with `openssl ecparam -name prime256v1 -genkey -noout -out KEY`")
    return key


def load_public(path: Path):
    """The EC P-256 public key in PEM file ``path``. Raises UsageError."""
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    try:
        key = load_pem_public_key(Path(path).read_bytes())
    except OSError as e:
        raise UsageError(f"cannot read the public key {path}: {e.strerror}") from e
    except ValueError as e:
        raise UsageError(f"{path} is not a PEM public key ({e})",
                         hint="export it with `openssl ec -in KEY -pubout -out KEY.pub` (or use cosign.pub)") from e
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
        raise UsageError(f"{path} is not an EC P-256 public key")
    return key


def sign(key, docker_reference: str, digest: str) -> tuple[bytes, bytes, bytes]:
    """Sign artifact ``digest`` with private ``key``. Returns ``(payload, config, manifest)``:
    the blobs to upload and the signature manifest to tag :func:`sig_tag` (``digest``)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    body = payload(docker_reference, digest)
    sig = base64.b64encode(key.sign(body, ec.ECDSA(hashes.SHA256()))).decode()
    config = json.dumps({"architecture": "", "os": "", "config": {},
                         "rootfs": {"type": "layers", "diff_ids": [oci.sha256(body)]}},
                        separators=(",", ":")).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": oci.OCI_MANIFEST,
        "config": {"mediaType": SIG_CONFIG_TYPE, "digest": oci.sha256(config), "size": len(config)},
        "layers": [{"mediaType": PAYLOAD_TYPE, "digest": oci.sha256(body), "size": len(body),
                    "annotations": {A_SIGNATURE: sig}}],
    }, separators=(",", ":")).encode()
    return body, config, manifest


def signature_layers(raw_manifest: bytes, where: str) -> list[tuple[str, int, bytes]]:
    """``(payload digest, size, signature bytes)`` of every simple-signing layer of a signature
    manifest. Raises SignatureError when it holds none."""
    try:
        doc = json.loads(raw_manifest)
        out = [(d["digest"], int(d["size"]), base64.b64decode(d["annotations"][A_SIGNATURE], validate=True))
               for d in doc.get("layers", []) if d.get("mediaType") == PAYLOAD_TYPE]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SignatureError(f"{where}: the signature manifest is malformed ({e})") from e
    if not out:
        raise SignatureError(f"{where}: the signature manifest holds no signature")
    return out


def signed_digest(pub, body: bytes, signature: bytes) -> str | None:
    """The artifact digest the simple-signing payload ``body`` names, when ``signature`` is
    ``pub``'s over it; None when it is not (or the payload names none)."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        pub.verify(signature, body, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        return None
    try:
        named = json.loads(body)["critical"]["image"]["docker-manifest-digest"]
    except (ValueError, KeyError, TypeError):
        return None
    return named if isinstance(named, str) else None


def verify(pub, body: bytes, signature: bytes, digest: str) -> bool:
    """True when ``signature`` is ``pub``'s over ``body`` and ``body`` names ``digest``."""
    return signed_digest(pub, body, signature) == digest


def fingerprint(pub) -> str:
    """``sha256:HEX`` of the public key's DER SubjectPublicKeyInfo (shown and recorded)."""
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return oci.sha256(pub.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo))
