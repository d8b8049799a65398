"""The control protocol between the supervisor and the engine root process.

Three pipes, all re-bound by CRIU ``--inherit-fd`` at restore (so they survive the dump):

* ``control`` (engine fd 0): supervisor -> engine, one JSON command per line.
* ``events``  (engine fd 3): engine -> supervisor, one JSON event per line.
* ``log``     (engine fds 1 and 2, inherited by EngineCore and workers): engine log text.

Commands (``{"cmd": ...}``): ``oracle`` (replay the oracle), ``sleep`` ``{level}``, ``wake``
(wake up, reload weights, reset prefix cache), ``prepare-dump``, ``serve`` ``{host, port}``,
``exit``. Events (``{"event": ...}``): ``initialized`` ``{oracle, info}``, ``oracle``
``{oracle}``, ``slept``, ``woken``, ``dump-ready``, ``serving`` ``{host, port}``, ``error``
``{kind, message}``. EOF on ``control`` before ``serve`` makes the engine exit (its
supervisor died); after ``serve`` the engine keeps serving (``--detach``).
"""

EVENTS_FD = 3
