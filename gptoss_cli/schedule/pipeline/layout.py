"""Pipeline stages of the Hybrid layer stack: which layers each stage holds, which rank holds it, the bubble.

Torch-free (the recipe rules and the memory estimate read it; docs/pipeline-parallel.md).

A *block* is one HF decoder block: an attention layer `*` and the layers after it up to the next
`*` (`*E` in GPT-OSS's pattern). Stages are cut between blocks only: a stage boundary never
separates an HF block's attention layer from its MoE layer (`BLOCK_RULE`). The stages come from,
in this order:

- `parallelism.pipeline_model_parallel_layout`, Megatron's `--pipeline-model-parallel-layout`
  grammar: `E` the embedding, `t` one decoder block, `L` the output layer and loss, `|` a stage
  boundary, `X*N` or `(...)*N` repetition, `,` and spaces ignored; e.g. `Et*8|t*10|t*10|t*8L`
  (the first and last stage hold fewer blocks, they also carry the embedding and the head);
- `|` in `model.hybrid_layer_pattern` (Megatron Hybrid's own stage splits), at block starts only;
- else the blocks divided evenly over PP x VPP stages.

Stage s of the PP x VPP stages runs on pipeline rank `s % PP` as its chunk `s // PP` (Megatron's
and torch's interleaved placement), or, for the V schedules (ZBV, DualPipeV: exactly two chunks per
rank), rank s for s < PP and rank 2 PP - 1 - s after (torch's `style="v"`: rank 0 holds the first
and the last stage).

`bubble_fraction` is the schedules' idle time in theory, from the per-microbatch times of a rank's
forward (f), backward for inputs (b) and deferred weight gradients (w).
"""

from __future__ import annotations

from dataclasses import dataclass

from gptoss_cli.errors import ConfigError
from gptoss_cli.model.pattern import ATTENTION, HybridPattern

SCHEDULES = ("1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")
# Two chunks per rank in a V: rank 0 holds the first and the last stage.
V_SCHEDULES = frozenset({"zbv_zero_bubble", "dualpipev"})
# Schedules that run the backward for inputs (I) and for weights (W) as separate actions.
SPLIT_BACKWARD = frozenset({"interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"})
BLOCK_RULE = ("a stage boundary never separates an HF block's attention layer from its MoE layer "
              "(`*E` stays whole)")
# Bounds that keep a hostile recipe from expanding into millions of stages (validate-config must answer
# at once): far beyond any pipeline anyone runs (Megatron's largest published layouts have tens of stages).
MAX_STAGES = 4096
MAX_LAYOUT_SYMBOLS = 1_000_000
LAYOUT_SYMBOLS = {"E": "the embedding", "t": "one decoder block (`*E`)", "L": "the output layer and loss",
                  "|": "a stage boundary"}


@dataclass(frozen=True)
class Stage:
    """One pipeline stage (a model chunk)."""

    index: int  # 0 .. PP x VPP - 1, in the order activations flow
    rank: int  # the pipeline rank that holds it
    chunk: int  # which of that rank's stages it is (0 first)
    blocks: tuple[int, int]  # HF blocks [first, last)
    layers: tuple[int, int]  # hybrid layers [start, end)
    embedding: bool  # holds the word embeddings (the first stage)
    loss: bool  # holds the final norm, the output layer and the loss (the last stage)

    @property
    def num_blocks(self) -> int:
        return self.blocks[1] - self.blocks[0]

    def text(self) -> str:
        """The stage in the layout grammar, e.g. `Et*8`."""
        n = self.num_blocks
        return ("E" if self.embedding else "") + ("t" if n == 1 else f"t*{n}" if n else "") + ("L" if self.loss else "")


@dataclass(frozen=True)
class PipelineLayout:
    pp: int
    vpp: int
    schedule: str
    stages: tuple[Stage, ...]
    source: str  # "even", "layout" (pipeline_model_parallel_layout) or "pattern" ('|' splits)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def rank_stages(self, rank: int) -> list[Stage]:
        """The stages pipeline rank `rank` holds, chunk 0 first."""
        return sorted((s for s in self.stages if s.rank == rank), key=lambda s: s.chunk)

    def rank_layers(self, rank: int) -> list[int]:
        """Every hybrid layer pipeline rank `rank` holds."""
        return [j for s in self.rank_stages(rank) for j in range(*s.layers)]

    def text(self) -> str:
        """The whole layout in Megatron's grammar, e.g. `Et*9|t*9|t*9|t*9L`."""
        return "|".join(s.text() for s in self.stages)


# --- Megatron's layout grammar -------------------------------------------------------------------
def _parse_sequence(text: str, pos: int, depth: int) -> tuple[list[str], int]:
    out: list[str] = []
    while pos < len(text):
        ch = text[pos]
        if ch == ")":
            if depth == 0:
                raise ConfigError(f"pipeline_model_parallel_layout {text!r}: ')' without '(' at position {pos}")
            return out, pos
        if ch == "(":
            inner, pos = _parse_sequence(text, pos + 1, depth + 1)
            if pos >= len(text):
                raise ConfigError(f"pipeline_model_parallel_layout {text!r}: '(' is never closed")
            item, pos = inner, pos + 1
        elif ch in LAYOUT_SYMBOLS:
            item, pos = [ch], pos + 1
        elif ch == "m":
            raise ConfigError(f"pipeline_model_parallel_layout {text!r}: 'm' (an MTP layer) at position {pos}, "
                              "but GPT-OSS has no multi-token-prediction layers")
        else:
            known = ", ".join(f"{k} ({v})" for k, v in LAYOUT_SYMBOLS.items())
            raise ConfigError(f"pipeline_model_parallel_layout {text!r}: unknown symbol {ch!r} at position {pos}",
                              hint=f"known: {known}, X*N and (...)*N repeat")
        if pos < len(text) and text[pos] == "*":
            end = pos + 1
            while end < len(text) and text[end].isdigit():
                end += 1
            if end == pos + 1:
                raise ConfigError(f"pipeline_model_parallel_layout {text!r}: '*' without a count at position {pos}")
            count = int(text[pos + 1:end])
            if len(item) * count + len(out) > MAX_LAYOUT_SYMBOLS:
                raise ConfigError(f"pipeline_model_parallel_layout {text!r} expands to more than "
                                  f"{MAX_LAYOUT_SYMBOLS:,} symbols")
            item, pos = item * count, end
        if len(out) + len(item) > MAX_LAYOUT_SYMBOLS:
            raise ConfigError(f"pipeline_model_parallel_layout {text!r} expands to more than {MAX_LAYOUT_SYMBOLS:,} symbols")
        out += item
    if depth:
        raise ConfigError(f"pipeline_model_parallel_layout {text!r}: '(' is never closed")
    return out, pos


def expand_layout(text: str) -> list[list[str]]:
    """The stages of a layout string, each a list of `E`, `t`, `L` (Megatron's grammar, see the module)."""
    compact = "".join(ch for ch in str(text) if not ch.isspace() and ch != ",")
    if not compact:
        raise ConfigError(f"pipeline_model_parallel_layout {text!r} is empty")
    symbols, _ = _parse_sequence(compact, 0, 0)
    stages: list[list[str]] = [[]]
    for sym in symbols:
        if sym == "|":
            stages.append([])
        else:
            stages[-1].append(sym)
    return stages


# --- blocks and stages ------------------------------------------------------------------------------
def block_starts(pattern: HybridPattern) -> list[int]:
    """The first hybrid layer of every HF block (each `*` starts one), then the number of layers."""
    starts = [j for j, s in enumerate(pattern.layers) if s == ATTENTION]
    if not starts or starts[0] != 0:
        starts = [0] + starts
    return starts + [pattern.num_layers]


def stage_place(index: int, pp: int, num_stages: int, v_style: bool) -> tuple[int, int]:
    """(pipeline rank, chunk) of stage `index` (see the module docstring)."""
    if v_style:
        return (index, 0) if index < pp else (num_stages - 1 - index, 1)
    return index % pp, index // pp


def _blocks_from_layout(text: str, num_blocks: int, num_stages: int) -> list[int]:
    stages = expand_layout(text)
    if len(stages) != num_stages:
        raise ConfigError(f"pipeline_model_parallel_layout {text!r} has {len(stages)} stages but PP x VPP = "
                          f"{num_stages}", hint="one '|' between consecutive stages")
    where = {sym: [i for i, st in enumerate(stages) if sym in st] for sym in "EL"}
    if where["E"] != [0] or stages[0].count("E") != 1 or stages[0][0] != "E":
        raise ConfigError(f"pipeline_model_parallel_layout {text!r}: the embedding 'E' must open the first stage, once")
    if where["L"] != [num_stages - 1] or stages[-1].count("L") != 1 or stages[-1][-1] != "L":
        raise ConfigError(f"pipeline_model_parallel_layout {text!r}: the loss 'L' must close the last stage, once")
    counts = [st.count("t") for st in stages]
    if sum(counts) != num_blocks:
        raise ConfigError(f"pipeline_model_parallel_layout {text!r} places {sum(counts)} decoder blocks ('t') but "
                          f"the model has {num_blocks}")
    return counts


def _blocks_from_pattern(pattern: HybridPattern, starts: list[int], num_stages: int) -> list[int]:
    if pattern.num_pipeline_stages != num_stages:
        raise ConfigError(f"hybrid_layer_pattern {pattern.text!r}: its '|' splits make {pattern.num_pipeline_stages} "
                          f"stages but PP x VPP = {num_stages}")
    block_of = {layer: b for b, layer in enumerate(starts[:-1])}
    cuts = []
    for split in pattern.pipeline_splits:
        if split not in block_of:
            raise ConfigError(f"hybrid_layer_pattern {pattern.text!r}: the '|' before layer {split} "
                              f"({pattern.layers[split]!r}) cuts an HF block: {BLOCK_RULE}",
                              hint="put '|' only before a '*'")
        cuts.append(block_of[split])
    bounds = [0, *cuts, len(starts) - 1]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def balanced_layout(num_blocks: int, num_stages: int) -> str:
    """A layout string placing the blocks as evenly as possible, the extra blocks on the middle
    stages (the first and last also carry the embedding and the head): what a rule suggests."""
    base, extra = divmod(num_blocks, num_stages)
    counts = [base] * num_stages
    order = sorted(range(num_stages), key=lambda s: (s in (0, num_stages - 1), abs(s - (num_stages - 1) / 2)))
    for s in order[:extra]:
        counts[s] += 1
    parts = [("t" if n == 1 else f"t*{n}" if n else "") for n in counts]
    parts[0] = "E" + parts[0]
    parts[-1] += "L"
    return "|".join(parts)


def pipeline_layout(pattern: HybridPattern, pp: int, vpp: int | None = None, schedule: str = "1f1b",
                    layout: str | None = None) -> PipelineLayout:
    """The stages of `pattern` over PP (x VPP) ranks for `schedule`; ConfigError naming what does not fit."""
    vpp = vpp or 1
    num_stages = pp * vpp
    if num_stages > MAX_STAGES:
        raise ConfigError(f"PP x VPP = {num_stages} pipeline stages: more than {MAX_STAGES} is not a pipeline",
                          hint="use fewer pipeline stages")
    starts = block_starts(pattern)
    num_blocks = len(starts) - 1
    if layout and pattern.pipeline_splits:
        raise ConfigError("both parallelism.pipeline_model_parallel_layout and '|' in model.hybrid_layer_pattern "
                          "place the stages", hint="use one of them")
    if layout:
        counts, source = _blocks_from_layout(layout, num_blocks, num_stages), "layout"
    elif pattern.pipeline_splits:
        counts, source = _blocks_from_pattern(pattern, starts, num_stages), "pattern"
    elif num_blocks % num_stages:
        raise ConfigError(f"{num_blocks} decoder blocks do not divide into PP x VPP = {num_stages} stages",
                          hint=f"set parallelism.pipeline_model_parallel_layout, e.g. "
                               f"{balanced_layout(num_blocks, num_stages)!r}")
    else:
        counts, source = [num_blocks // num_stages] * num_stages, "even"
    v_style = schedule in V_SCHEDULES
    stages, first = [], 0
    for i, n in enumerate(counts):
        rank, chunk = stage_place(i, pp, num_stages, v_style)
        stages.append(Stage(index=i, rank=rank, chunk=chunk, blocks=(first, first + n),
                            layers=(starts[first], starts[first + n]), embedding=i == 0, loss=i == num_stages - 1))
        first += n
    return PipelineLayout(pp=pp, vpp=vpp, schedule=schedule, stages=tuple(stages), source=source)


# --- schedules -----------------------------------------------------------------------------------------
def schedule_problems(schedule: str, pp: int, vpp: int | None, microbatches: int | None) -> list[tuple[str, str]]:
    """(what is wrong, the fix) for running `schedule` with PP, VPP and this many microbatches per
    step and data-parallel rank; empty when torch's schedule accepts it."""
    vpp = vpp or 1
    out: list[tuple[str, str]] = []
    if schedule not in SCHEDULES:
        return [(f"pipeline_schedule {schedule!r} is not one of {', '.join(SCHEDULES)}", "choose one of them")]
    if schedule == "1f1b" and vpp != 1:
        out.append((f"1f1b runs one stage per rank, but virtual_pipeline_model_parallel_size={vpp}",
                    "use pipeline_schedule=interleaved_1f1b (or interleaved_zero_bubble), or VPP null"))
    if schedule == "interleaved_1f1b" and vpp < 2:
        out.append(("interleaved_1f1b needs virtual stages (VPP >= 2)",
                    "set parallelism.virtual_pipeline_model_parallel_size >= 2, or pipeline_schedule=1f1b"))
    if schedule in V_SCHEDULES and vpp != 2:
        out.append((f"{schedule} runs exactly two stages per rank in a V, but VPP={vpp}",
                    "set parallelism.virtual_pipeline_model_parallel_size=2"))
    if microbatches is None:
        return out
    m = microbatches
    if schedule == "1f1b" and m < pp:
        out.append((f"1f1b needs at least PP={pp} microbatches per step, got {m}",
                    "raise training.global_batch_size or lower micro_batch_size"))
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble"):
        rounds = max(1, m // pp)
        if m % rounds:
            out.append((f"{schedule} needs the {m} microbatches to be a multiple of its {rounds} rounds "
                        f"(max(1, microbatches // PP))", f"use a multiple of PP={pp} microbatches"))
    if schedule == "dualpipev" and m < 2 * pp:
        out.append((f"dualpipev needs at least 2 x PP = {2 * pp} microbatches per step, got {m}",
                    "raise training.global_batch_size"))
    return out


def in_flight(schedule: str, pp: int, vpp: int | None, microbatches: int, rank: int) -> float:
    """Microbatches whose activations pipeline rank `rank` holds at its peak, in units of one microbatch
    through ALL of its stages (a chunk holds 1 / VPP of that): the schedules' warm-up depth.

    1F1B: PP - rank (the first stage holds PP). Interleaved 1F1B and ZB1P run torch's warm-up of
    (VPP - 1) x microbatches-per-round + 2 (PP - 1 - rank) chunk forwards (once, not twice, the
    distance for ZB1P), plus the one in progress. ZBV holds PP (ZB-V's claim: 1F1B's memory), DualPipeV
    PP + 1 (DeepSeek's table)."""
    vpp = vpp or 1
    m = microbatches
    if schedule == "1f1b" or pp <= 1:
        return float(min(m, pp - rank))
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble"):
        per_round = m // max(1, m // pp)
        factor = 2 if schedule == "interleaved_1f1b" else 1
        chunks = min(vpp * m, (vpp - 1) * per_round + factor * (pp - 1 - rank) + 1)
        return chunks / vpp
    return float(min(m, pp + (1 if schedule == "dualpipev" else 0)))


def bubble_fraction(schedule: str, pp: int, vpp: int | None, microbatches: int, f: float = 1.0, b: float = 1.0,
                    w: float = 1.0) -> float:
    """The share of a step a rank idles in theory (equal stages, no communication time): idle /
    (idle + work), work = microbatches x (f + b + w) with f, b, w a rank's forward, backward for
    inputs and deferred weight-gradient time of one microbatch.

    1F1B idles (PP - 1)(f + b + w); interleaving divides it by VPP (Narayanan et al. 2021); the
    zero-bubble family fills it with the deferred weight gradients, leaving (PP - 1)(f + b - w) / VPP
    (ZB-H1, Qi et al. 2024; the `(PP-1)(F+B-2W)` of DeepSeek's DualPipe table, B there being the
    whole backward)."""
    vpp = vpp or 1
    work = microbatches * (f + b + w)
    if pp <= 1 or work <= 0:
        return 0.0
    if schedule == "1f1b":
        idle = (pp - 1) * (f + b + w)
    elif schedule == "interleaved_1f1b":
        idle = (pp - 1) * (f + b + w) / vpp
    else:
        idle = (pp - 1) * max(f + b - w, 0.0) / vpp
    return idle / (idle + work)


__all__ = ["SCHEDULES", "V_SCHEDULES", "SPLIT_BACKWARD", "BLOCK_RULE", "Stage", "PipelineLayout", "expand_layout", "in_flight",
           "block_starts", "stage_place", "balanced_layout", "pipeline_layout", "schedule_problems", "bubble_fraction"]
