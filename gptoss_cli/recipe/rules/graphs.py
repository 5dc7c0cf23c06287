"""CUDA graphs and activation recompute settings."""

from __future__ import annotations

from gptoss_cli.model.recompute_plan import SELECTIVE_MODULES
from gptoss_cli.recipe.rules.core import ERROR, WARNING, Context, Finding, error, rule, short_pattern, warning
from gptoss_cli.recipe.schema import RecipeConfig


# --- CUDA graphs and recompute -------------------------------------------------------------------
@rule("cuda_graphs.paged_stash_requires_full_iteration", "paged_stash needs cuda_graph_impl=full_iteration",
      fix="set cuda_graphs.paged_stash=false, or cuda_graphs.cuda_graph_impl=full_iteration")
def paged_stash(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    g = cfg.cuda_graphs
    if not g.paged_stash or g.cuda_graph_impl == "full_iteration":
        return []
    return [error({"cuda_graphs.paged_stash": True, "cuda_graphs.cuda_graph_impl": g.cuda_graph_impl},
                  "the paged activation stash exists only for full-iteration CUDA graphs")]


@rule("cuda_graphs.requires_cuda", "CUDA graphs need system.device=cuda (or auto)",
      fix="cuda_graphs.cuda_graph_impl=none on the CPU")
def graphs_need_cuda(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    g = cfg.cuda_graphs
    if g.cuda_graph_impl == "none" or cfg.system.device != "cpu":
        return []
    return [error({"cuda_graphs.cuda_graph_impl": g.cuda_graph_impl, "system.device": "cpu"},
                  "CUDA graphs cannot run on the CPU", "set cuda_graphs.cuda_graph_impl=none")]


@rule("cuda_graphs.scope", "cuda_graph_scope applies to cuda_graph_impl=local only",
      fix="cuda_graphs.cuda_graph_scope=[] unless cuda_graph_impl=local", severities=(WARNING,))
def graph_scope(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    g = cfg.cuda_graphs
    if not g.cuda_graph_scope or g.cuda_graph_impl == "local":
        return []
    return [warning({"cuda_graphs.cuda_graph_scope": list(g.cuda_graph_scope),
                     "cuda_graphs.cuda_graph_impl": g.cuda_graph_impl},
                    f"cuda_graph_scope is ignored with cuda_graph_impl={g.cuda_graph_impl!r}",
                    "set cuda_graphs.cuda_graph_scope=[]")]


@rule("recompute.settings",
      "full recompute needs method + num_layers; selective takes modules, not method/num_layers",
      fix="full: recompute_method and recompute_num_layers, no modules (a warning); selective: "
          "recompute_modules, method and num_layers null",
      severities=(ERROR, WARNING))
def recompute_settings(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    r = cfg.recompute
    fields = {"recompute.recompute_granularity": r.recompute_granularity}
    if r.recompute_granularity == "full":
        if r.recompute_method is None or r.recompute_num_layers is None:
            return [error({**fields, "recompute.recompute_method": r.recompute_method,
                           "recompute.recompute_num_layers": r.recompute_num_layers},
                          "full recompute needs recompute_method and recompute_num_layers",
                          "e.g. recompute.recompute_method=uniform recompute.recompute_num_layers=1")]
        if r.recompute_modules:
            return [warning({**fields, "recompute.recompute_modules": list(r.recompute_modules)},
                            "recompute_modules is ignored with full recompute", "set recompute.recompute_modules=[]")]
        return []
    if r.recompute_method is not None or r.recompute_num_layers is not None:
        return [error({**fields, "recompute.recompute_method": r.recompute_method,
                       "recompute.recompute_num_layers": r.recompute_num_layers},
                      f"recompute_method/num_layers apply to full recompute only, granularity is "
                      f"{r.recompute_granularity!r}",
                      "set recompute.recompute_method=null recompute.recompute_num_layers=null")]
    if r.recompute_granularity == "selective" and not r.recompute_modules:
        return [error(fields, "selective recompute with no recompute_modules recomputes nothing",
                      "e.g. recompute.recompute_modules=[core_attn]")]
    if r.recompute_granularity == "none" and r.recompute_modules:
        return [warning({**fields, "recompute.recompute_modules": list(r.recompute_modules)},
                        "recompute_modules is ignored without selective recompute",
                        "set recompute.recompute_granularity=selective, or recompute.recompute_modules=[]")]
    return []




@rule("recompute.layers",
      "recompute_num_layers within the model's physical layers; selective modules that the pattern has a layer for",
      fix="full: recompute.recompute_num_layers at most the number of hybrid layers (2 per HF block); "
          "selective: drop modules without a layer (a warning)",
      severities=(ERROR, WARNING))
def recompute_layers(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    r = cfg.recompute
    layers = ctx.pattern.layers
    if r.recompute_granularity == "full" and r.recompute_num_layers is not None and r.recompute_num_layers > len(layers):
        return [error({"recompute.recompute_num_layers": r.recompute_num_layers,
                       "model.hybrid_layer_pattern": short_pattern(ctx.pattern.text)},
                      f"recompute_num_layers={r.recompute_num_layers} is beyond the model's {len(layers)} hybrid "
                      f"layers (recompute counts physical layers: 2 per HF block)",
                      f"set recompute.recompute_num_layers to at most {len(layers)}")]
    if r.recompute_granularity != "selective":
        return []
    idle = [m for m in r.recompute_modules if not any(s in SELECTIVE_MODULES.get(m, "") for s in layers)]
    if idle:
        return [warning({"recompute.recompute_modules": list(r.recompute_modules),
                         "model.hybrid_layer_pattern": short_pattern(ctx.pattern.text)},
                        f"recompute module(s) {idle} have no layer in the pattern and recompute nothing",
                        f"remove {idle} from recompute.recompute_modules")]
    return []
