"""The engine side, and the leaves both sides of the engine channel share: the channel
(protocol), the engine-argument rules (args), the mount and network namespace policies (mounts,
net) and the pre-dump preparation (prep) import only the base modules; ``main`` is the engine
root's program (it runs inside the snapshotted tree)."""
