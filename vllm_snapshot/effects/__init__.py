"""The seam between operations and the host: every side effect an operation has goes through
the Protocols here (LocalTools does them; tests pass fakes). Imports everything below the operations."""
