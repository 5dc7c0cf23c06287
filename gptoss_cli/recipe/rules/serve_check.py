"""serve_check: the end-of-run check that the serving engine computes what training computed."""

from __future__ import annotations

from gptoss_cli.recipe.rules.core import Context, Finding, error, rule
from gptoss_cli.recipe.schema import RecipeConfig


@rule("serve_check.engine", "serve_check.engine needs a checkpoint to check (checkpoint.dir); at launch, the "
      "engine's Python (serve_check.engine_python or $GPTOSS_ENGINE_PYTHON, else this one with vLLM) exists",
      fix="set checkpoint.dir, and serve_check.engine_python to the python of the venv vLLM is installed in")
def serve_check_engine(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    sc = cfg.serve_check
    if sc.engine is None:
        return []
    if not cfg.checkpoint.dir:
        return [error({"serve_check.engine": sc.engine, "checkpoint.dir": None},
                      f"serve_check.engine={sc.engine} checks the final checkpoint, but checkpoint.dir is null: "
                      "nothing is saved", "set checkpoint.dir")]
    if not ctx.check_paths:
        return []
    # Only at launch (train): the engine is installed on the training machine, not necessarily here.
    from gptoss_cli.errors import GptossError  # noqa: PLC0415
    from gptoss_cli.generate.engines.vllm_offline import engine_python  # noqa: PLC0415

    try:
        engine_python(sc.engine_python)
    except GptossError as exc:
        return [error({"serve_check.engine_python": sc.engine_python}, exc.message,
                      exc.hint or "install the engine in its own venv (docs/serve-check.md)")]
    return []
