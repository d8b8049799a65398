"""What operations report: their results (frozen data the command line renders) and their
progress (phase lines, systemd notify). Used by the operations and the command line; imports
the store and the host only."""
