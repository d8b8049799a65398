"""The seam between operations and the host: every side effect an operation has goes through
one of the role Protocols of :mod:`.protocols`, bundled by :class:`.tools.Tools`
(:func:`.tools.local_tools` builds the real ones; tests pass fakes). Imports everything below
the operations."""
