"""The rule registry's core: findings, the `rule` decorator, the context rules read, shared helpers.

A rule is `fn(cfg, ctx) -> list[Finding]`, registered with
`@rule(id, description, fix=..., severities=..., kind=..., gate=...)`. The registry fills in the
rule id and kind, so each function only says what is wrong and how to fix it in the case at hand;
`fix` (the usual way out) and `severities` (what the rule can report) are the rule's
documentation, rendered into docs/rules.md by rules/docs.py; a finding created without a hint shows
the rule's `fix`, so a rule whose one way out is always the same writes it once. Two kinds:
- "semantic": Megatron's own constraints and the model's capabilities; a recipe that breaks one
  cannot work anywhere (docs/megatron-rules.md).
- "unsupported" (ids `unsupported.*`, rules/unsupported.py): options `gptoss train` does not
  implement yet. Errors for the `gptoss` target, notes for the `megatron` target.
A *gate* rule runs first; when it reports an error the other rules are skipped (their arithmetic
would be meaningless), see recipe/validate.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from gptoss_cli.model.config import GptOssArch
from gptoss_cli.model.pattern import HybridPattern
from gptoss_cli.fp8.catalog import RECIPES as FP8_RECIPES
from gptoss_cli.recipe.estimate.memory import MemoryEstimate, estimate_memory
from gptoss_cli.recipe.schema import RecipeConfig

ERROR = "error"
WARNING = "warning"
SEMANTIC = "semantic"
UNSUPPORTED = "unsupported"

# What `gptoss train` implements today. Widen an entry when the feature lands and its
# unsupported.* rule goes quiet; nothing else needs to change.
IMPLEMENTED = {
    "token_dispatchers": frozenset({"alltoall"}),
    "fp8_recipes": frozenset({"none", *FP8_RECIPES}),  # every recipe of gptoss_cli/fp8/catalog.py
    "checkpoint_formats": frozenset({"gptoss"}),
}

@dataclass(frozen=True)
class Finding:
    """One problem: which rule, how bad, which fields with which values, what is wrong, the fix."""

    rule: str
    severity: str  # "error" | "warning"
    fields: dict[str, Any]
    message: str
    hint: str | None = ""  # None (error()/warning() without a hint): the rule's `fix`, filled in by Rule
    kind: str = SEMANTIC  # "semantic" | "unsupported"
    # a launch-time input (a data or checkpoint path) is missing or unreadable: train exits 2 (bad
    # input) on it, where a rule error of the recipe itself exits 1
    bad_input: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def error(fields: dict[str, Any], message: str, hint: str | None = None, *, bad_input: bool = False) -> Finding:
    """An error finding; without a hint it shows the rule's `fix` (write the exact fix there once).
    `bad_input`: a file the recipe names is missing or unreadable (train exits 2 on it)."""
    return Finding(rule="", severity=ERROR, fields=fields, message=message, hint=hint, bad_input=bad_input)


def warning(fields: dict[str, Any], message: str, hint: str | None = None) -> Finding:
    return Finding(rule="", severity=WARNING, fields=fields, message=message, hint=hint)

# --- context ---------------------------------------------------------------------------------
@dataclass
class Context:
    """What rules need besides the config: the architecture and pattern, the world size, the target machine."""

    arch: GptOssArch
    pattern: HybridPattern
    world_size: int
    world_size_source: str
    explicit_world_size: int | None = None
    gpu: str = "auto"  # the GPU generation (recipe's system.gpu, or detected by train)
    torch_version: str = ""
    check_paths: bool = False  # train sets this: data and checkpoint paths must exist here
    _memory: tuple[RecipeConfig, MemoryEstimate | None, Exception | None] | None = field(
        default=None, init=False, repr=False, compare=False)

    def memory_estimate(self, cfg: RecipeConfig) -> MemoryEstimate | None:
        """estimate_memory of `cfg` in this context, computed once: validate's report and the memory
        rule read the same object. A failure is raised again on every call (the rule reports it)."""
        cached = self._memory
        if cached is None or cached[0] is not cfg:
            try:
                cached = (cfg, estimate_memory(cfg, self.arch, self.pattern, self.world_size, self.gpu), None)
            except Exception as exc:  # kept for the next caller too, raised below
                cached = (cfg, None, exc)
            self._memory = cached
        if cached[2] is not None:
            raise cached[2]
        return cached[1]



# --- the registry ----------------------------------------------------------------------------
RuleFn = Callable[[RecipeConfig, Context], "Iterable[Finding] | None"]


@dataclass(frozen=True)
class Rule:
    id: str
    kind: str
    description: str
    fn: RuleFn = field(repr=False)
    gate: bool = False  # runs first; its errors stop the other rules
    fix: str = ""  # the usual fix, in general terms; the hint of a finding created without one
    severities: tuple[str, ...] = (ERROR,)  # what its findings can be (tests check the triggered ones)

    def __call__(self, cfg: RecipeConfig, ctx: Context) -> list[Finding]:
        return [dataclasses.replace(f, rule=self.id, kind=self.kind, hint=self.fix if f.hint is None else f.hint)
                for f in (self.fn(cfg, ctx) or [])]


RULES: dict[str, Rule] = {}


def rule(rule_id: str, description: str, *, fix: str, severities: tuple[str, ...] = (ERROR,),
         kind: str = SEMANTIC, gate: bool = False) -> Callable[[RuleFn], RuleFn]:
    """Register `fn(cfg, ctx) -> list[Finding]` under `rule_id`; the function stays callable as is."""

    def register(fn: RuleFn) -> RuleFn:
        register_rule(Rule(rule_id, kind, description, fn, gate, fix, severities))
        return fn

    return register


def register_rule(r: Rule) -> None:
    if not r.fix:
        raise ValueError(f"rule {r.id!r} has no fix: say how a user gets out of it")
    if not r.severities or set(r.severities) - {ERROR, WARNING}:
        raise ValueError(f"rule {r.id!r}: severities {r.severities!r} must be error and/or warning")
    if r.id in RULES:
        raise ValueError(f"rule {r.id!r} registered twice")
    RULES[r.id] = r


def list_rules() -> list[tuple[str, str, str]]:
    """(id, kind, description) of every rule, in the order they run (docs/rules.md's rule list)."""
    return [(r.id, r.kind, r.description) for r in RULES.values()]


# --- helpers shared by the rule modules ---------------------------------------------------------
def field_value(obj: Any, dotted: str) -> Any:
    """cfg's value of a dotted field name, e.g. "training.lr"."""
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def short_pattern(text: str) -> str:
    """'*E*E...*E' (72 chars) shown as "'*E' x 36"; anything else up to 40 characters."""
    compact = "".join(text.split())
    if len(compact) >= 4 and len(compact) % 2 == 0 and compact == compact[:2] * (len(compact) // 2):
        return f"{compact[:2]!r} x {len(compact) // 2}"
    return compact if len(compact) <= 40 else compact[:37] + "..."


def version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)



__all__ = ["Finding", "Rule", "Context", "RULES", "rule", "register_rule", "list_rules", "error", "warning",
           "IMPLEMENTED", "field_value", "short_pattern", "version_tuple",
           "ERROR", "WARNING", "SEMANTIC", "UNSUPPORTED"]
