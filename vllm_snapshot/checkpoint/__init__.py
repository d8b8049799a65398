"""CRIU and what a dump must know: the CRIU runner and its options, the CUDA checkpoint helper,
the process-tree inventory, link-remap files and the external-mount policy. Imports store, host, engine leaves, base."""
