"""The host as it is: processes, privileges, identity, cgroups, memory, ports, GPUs, systemd
notify, signals, the code's identity. Leaves: import only the base modules (errors, paths, units) and
the engine leaves both sides share (engine.args, engine.protocol)."""
