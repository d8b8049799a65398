"""The model directory: :class:`LocalModelTools`, :class:`~vllm_snapshot.effects.protocols.ModelTools`
over :mod:`vllm_snapshot.store.model_digest` and vLLM's argument parser."""

from __future__ import annotations

from pathlib import Path

from ..store.manifest import ModelFile
from ..store.model_digest import ModelCheck
from .protocols import ModelTools


class LocalModelTools(ModelTools):
    """:class:`ModelTools` over the model directory (:mod:`vllm_snapshot.store.model_digest`)."""

    def resolve_model(self, model: str, revision: str | None) -> tuple[Path, str | None]:
        from ..store import model_digest

        return model_digest.resolve_model(model, revision)

    def check_model_config(self, model_dir: Path, engine_args: list[str]) -> None:
        from ..store import model_digest

        model_digest.check_config(model_dir, engine_args)

    def digest_model(self, model_dir: Path, known: tuple[ModelFile, ...] = ()) -> tuple[ModelFile, ...]:
        from ..store import model_digest

        return model_digest.digest_dir(model_dir, known)

    def model_stats(self, model_dir: Path, files: tuple[ModelFile, ...]) -> tuple[ModelFile, ...]:
        from ..store import model_digest

        return model_digest.stat_pins(model_dir, files)

    def recheck_model(self, model_dir: Path, pinned: tuple[ModelFile, ...], since_ns: int, during: str,
                      hint: str) -> tuple[str, ...]:
        from ..store import model_digest

        return model_digest.recheck(model_dir, pinned, since_ns, during=during, hint=hint)

    def normalize_engine_args(self, engine_args: list[str]) -> dict[str, str]:
        import contextlib
        import io

        from ..engine.args import normalize_args
        from ..errors import UsageError
        from ..suggest import did_you_mean

        captured = io.StringIO()
        try:
            with contextlib.redirect_stderr(captured):
                from ..store import argnames

                # the next typo is answered from these names, without vLLM
                return normalize_args(list(engine_args),
                                      on_parser=lambda p: argnames.remember(argnames.parser_options(p),
                                                                             argnames.parser_arities(p)))
        except SystemExit as e:
            from ..engine.args import argparse_reason
            from ..store import argnames

            reason = argparse_reason(captured.getvalue())
            options = argnames.known_options()  # the parse above remembered them
            bad = argnames.unknown_flags(list(engine_args), options) if options else []
            guess = did_you_mean(bad[0], options) if bad and options else None
            raise UsageError(f"invalid engine arguments: {reason}",
                             hint=guess or "the engine args are those of `vllm serve`") from e

    def verify_model(self, model_dir: Path, files: tuple[ModelFile, ...], mode: str) -> ModelCheck:
        from ..store import model_digest

        return model_digest.verify(model_dir, files, "full" if mode == "full" else "quick")
