"""What an engine root is launched with: :class:`EngineSpec`, built by ``create``
(:mod:`vllm_snapshot.ops.create`), handed through the seam
(:meth:`vllm_snapshot.effects.protocols.EngineTools.launch_engine`) to the supervisor, which
passes it as the engine root's last argument, one JSON object
(:func:`vllm_snapshot.supervise.supervisor.launch`); the engine root
(:mod:`vllm_snapshot.entrypoints.engine_root`) reads it back with :meth:`EngineSpec.from_json`.

The JSON is the engine root's command line, so it is also how other code finds an engine
tree: :mod:`vllm_snapshot.store.registry` looks for :data:`ROOT_MARK` in a root's last
argument (a restored tree's argv is the one recorded at create, so the mark never changes), and :mod:`vllm_snapshot.engine.mounts` reads ``model`` and ``weights_root`` from it
before vLLM starts. Pure."""

from __future__ import annotations

import json
from dataclasses import dataclass

#: What every engine spec's JSON holds, and what marks an engine tree's root among processes
#: (its last argument): the ``oracle_prompt`` key.
ROOT_MARK = '"oracle_prompt"'


@dataclass(frozen=True)
class RunAs:
    """The unprivileged user the engine tree runs as once its namespaces are set up: ``name``,
    ``uid``, primary ``gid``, supplementary ``groups`` (gids), ``home`` (its HOME directory).
    The same fields as :class:`vllm_snapshot.store.manifest.EngineUser`, the manifest's record."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str


@dataclass(frozen=True)
class EngineSpec:
    """One engine root's launch description.

    ``model``: the local model directory; ``engine_args``: the ``vllm serve`` arguments
    (create's, front-end options excluded); ``oracle_prompt``: the prompt whose first token the
    engine records as the oracle; ``sleep_level``: 0 (full state captured), 1 or 2 (CUDA:
    vLLM's sleep level before the dump; a CPU engine ignores it); ``user``: who the tree runs
    as (None: stays root, as the tests' fake engine may); ``weights_file``: a CPU engine's
    workers write their weights into one file of the store and map it (``--weights file``);
    ``weights_root``: that store's root (the directory holding ``.weights``; None without a
    weights file); ``served_model_name``: the name to serve under when the engine args give
    none (a Hugging Face id, served by its id as ``vllm serve`` does; None: vLLM's default)."""

    model: str
    engine_args: tuple[str, ...]
    oracle_prompt: str
    sleep_level: int = 0
    user: RunAs | None = None
    weights_file: bool = False
    weights_root: str | None = None
    served_model_name: str | None = None

    def to_json(self) -> str:
        """The engine root's argument: a JSON object with every field (``user`` an object,
        ``groups`` and ``engine_args`` lists), ``served_model_name`` only when set."""
        d: dict = {"model": self.model, "engine_args": list(self.engine_args), "oracle_prompt": self.oracle_prompt,
                   "sleep_level": self.sleep_level,
                   "user": None if self.user is None else {
                       "name": self.user.name, "uid": self.user.uid, "gid": self.user.gid,
                       "groups": list(self.user.groups), "home": self.user.home},
                   "weights_file": self.weights_file, "weights_root": self.weights_root}
        if self.served_model_name is not None:
            d["served_model_name"] = self.served_model_name
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> EngineSpec:
        """Read :meth:`to_json`'s output back; a field left out takes its default (only
        ``model`` and ``oracle_prompt`` are required). Raises ValueError (not JSON, not an
        object, a required field missing, an id or level that is not a number)."""
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("an engine spec is a JSON object")
        try:
            u = d.get("user")
            user = None if u is None else RunAs(name=str(u["name"]), uid=int(u["uid"]), gid=int(u["gid"]),
                                                groups=tuple(int(g) for g in u["groups"]), home=str(u["home"]))
            return cls(model=str(d["model"]), engine_args=tuple(str(a) for a in d.get("engine_args", [])),
                       oracle_prompt=str(d["oracle_prompt"]), sleep_level=int(d.get("sleep_level", 0)),
                       user=user, weights_file=bool(d.get("weights_file", False)),
                       weights_root=d.get("weights_root"), served_model_name=d.get("served_model_name"))
        except (KeyError, TypeError) as e:
            raise ValueError(f"not an engine spec: {e!r}") from e
