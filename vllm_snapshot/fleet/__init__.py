"""Fleet: snapshots as OCI artifacts in registries and OCI image-layout directories.

``reference`` parses IMAGE references; ``oci`` is the artifact format (media types,
annotations, layer plan; pure); ``transport`` moves blobs and manifests (registry over the
OCI distribution API, or an image-layout directory), every blob's digest checked as it
streams; ``sign`` is the cosign-compatible signature; ``transfer`` pushes and pulls a snapshot
directory (staging + rename); ``weights`` places the weights file a CPU snapshot references at
its recorded path on the pulling node. docs/oci-format.md is the format's description.

Layering: this package imports the base modules, ``host`` and ``store``; ``ops``/``cli``
import it, never the reverse.
"""
