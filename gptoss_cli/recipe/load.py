"""Load a recipe: find the file, merge its bases and dotlist overrides, type-check, resolve the model.

`load_recipe("gb200_bf16", ["training.train_iters=10"])` returns a `Recipe`: the typed
`RecipeConfig`, the `GptOssArch` it describes and the parsed `HybridPattern`. Anything that is
not a recipe (missing file, not YAML, unknown key, wrong type, unknown choice) raises ConfigError
(exit 2) naming the file, the dotted key and the value, with a "did you mean" where one is close.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import gptoss_cli
from gptoss_cli.errors import ConfigError, GptossError
from gptoss_cli.checkpoint import formats
from gptoss_cli.model.catalog import MLP_TARGETS, TARGET_MODULES
from gptoss_cli.model.config import INT_LIMITS, PRESETS, GptOssArch
from gptoss_cli.model.pattern import MLP, MOE, HybridPattern, parse_pattern
from gptoss_cli.recipe.schema import RecipeConfig, iter_fields



def _recipes_dir() -> Path:
    """The repository's recipes/ folder (editable install), else its copy shipped as package data
    (`gptoss_cli/recipes_data`, see pyproject.toml)."""
    package = Path(gptoss_cli.__file__).resolve().parent
    for candidate in (package.parent / "recipes", package / "recipes_data"):
        if candidate.is_dir():
            return candidate
    return package.parent / "recipes"


RECIPES_DIR = _recipes_dir()
BASE_KEY = "base"
_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass(frozen=True)
class Recipe:
    """A loaded, type-checked recipe and the model it describes."""

    config: RecipeConfig
    arch: GptOssArch
    pattern: HybridPattern
    path: Path | None
    sources: tuple[Path, ...]  # the recipe file and its bases, in merge order (bases first)
    overrides: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.config.name

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe as plain data (what a run directory records)."""
        return OmegaConf.to_container(OmegaConf.structured(self.config), resolve=True)  # type: ignore[return-value]

    def to_yaml(self) -> str:
        return OmegaConf.to_yaml(OmegaConf.structured(self.config))


def _is(path: Path, kind: str) -> bool:
    """path.is_file()/is_dir() that treats unusable names (NUL bytes, too long) as absent."""
    try:
        return path.is_file() if kind == "file" else path.is_dir()
    except (OSError, ValueError):
        return False


# --- finding the file -----------------------------------------------------------------------
def available_recipes(recipes_dir: Path = RECIPES_DIR) -> list[str]:
    """Names of the recipes in recipes/ (bases live in recipes/bases/ and are not listed)."""
    if not recipes_dir.is_dir():
        return []
    return sorted(p.stem for p in recipes_dir.glob("*.yaml"))


def find_recipe(ref: str | Path, recipes_dir: Path = RECIPES_DIR) -> Path:
    """A recipe argument is a path, or a bare name (with or without .yaml) in the repo's recipes/."""
    path = Path(ref).expanduser()
    if _is(path, "file"):
        return path
    if _is(path, "dir"):
        raise ConfigError(f"recipe {str(ref)!r} is a directory, not a YAML file")
    text = str(ref)
    if "/" not in text and "\\" not in text:
        stem = text[:-5] if text.endswith(".yaml") else text[:-4] if text.endswith(".yml") else text
        for cand in (recipes_dir / f"{stem}.yaml", recipes_dir / f"{stem}.yml"):
            if cand.is_file():
                return cand
        names = available_recipes(recipes_dir)
        close = difflib.get_close_matches(stem, names, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else f"recipes in {recipes_dir}: {', '.join(names) or 'none'}"
        raise ConfigError(f"recipe {text!r} not found (no such file, and no recipes/{stem}.yaml)", hint=hint)
    raise ConfigError(f"recipe file {text!r} not found")


# --- reading and composing ------------------------------------------------------------------
def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        conf = OmegaConf.load(path)
    except OSError as exc:
        raise ConfigError(f"recipe file {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    except Exception as exc:  # yaml.YAMLError, UnicodeDecodeError, OmegaConf errors: the file is not YAML
        hint = "quote values that start with * or &, e.g. hybrid_layer_pattern: '*E*E'" if "alias" in str(exc) else None
        raise ConfigError(f"recipe file {str(path)!r} is not valid YAML: {_first_line(exc)}", hint=hint) from None
    if not isinstance(conf, DictConfig):
        raise ConfigError(
            f"recipe file {str(path)!r} is not a YAML mapping (found a {type(conf).__name__})",
            hint="a recipe is a mapping of groups such as model:, parallelism:, training:",
        )
    try:
        data = OmegaConf.to_container(conf, resolve=False)
    except OmegaConfBaseException as exc:  # pragma: no cover - defensive
        raise ConfigError(f"recipe file {str(path)!r}: {_first_line(exc)}") from None
    return data  # type: ignore[return-value]


def _find_base(path: Path, base: str, recipes_dir: Path) -> Path:
    """A `base:` entry: a file relative to the recipe that names it; else a shipped one, by name as --recipe
    finds it (`tiny_cpu_sft`) or by its path in recipes/ (`bases/tiny_cpu.yaml`, what a shipped recipe copied
    elsewhere names)."""
    local = (path.parent / base).expanduser()
    if _is(local, "file"):
        return local
    shipped = [recipes_dir / base]
    if "/" not in base and "\\" not in base and not base.endswith((".yaml", ".yml")):
        shipped = [recipes_dir / f"{base}.yaml", recipes_dir / f"{base}.yml"]
    for cand in shipped:
        if _is(cand, "file"):
            return cand
    raise ConfigError(f"{path}: base recipe {base!r} not found (looked for {local}, and for the shipped recipe "
                      f"{shipped[0]})", hint="a base is a file relative to the recipe file, or a shipped recipe's name "
                      f"({', '.join(available_recipes(recipes_dir)[:4])}, ...)")


def _compose(path: Path, stack: tuple[Path, ...] = (), recipes_dir: Path = RECIPES_DIR
             ) -> tuple[dict[str, Any], list[Path]]:
    """The recipe at `path` with its bases merged under it (bases in order, then the file itself)."""
    path = path.resolve()
    if path in stack:
        chain = " -> ".join(p.name for p in (*stack, path))
        raise ConfigError(f"recipe bases form a cycle: {chain}")
    data = _read_yaml(path)
    bases = data.pop(BASE_KEY, None)
    if bases is None:
        bases = []
    elif isinstance(bases, str):
        bases = [bases]
    elif not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{path}: `{BASE_KEY}` must be a file name or a list of file names, got {bases!r}")
    merged: dict[str, Any] = {}
    sources: list[Path] = []
    for base in bases:
        base_data, base_sources = _compose(_find_base(path, base, recipes_dir), (*stack, path), recipes_dir)
        merged = _merge(merged, base_data)
        sources.extend(s for s in base_sources if s not in sources)
    merged = _merge(merged, data)
    sources.append(path)
    return merged, sources


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Deep merge of plain mappings: mappings merge key by key, anything else (lists too) replaces."""
    out = dict(a)
    for key, value in b.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """`key.sub=value` items into a nested mapping; values are YAML (`null`, `true`, `[a, b]`, `1e-4`)."""
    merged: dict[str, Any] = {}
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value",
                              hint="e.g. training.train_iters=10 overlap.delay_wgrad_compute=false")
        key, _, value = item.partition("=")
        key = key.strip()
        if not _KEY_RE.match(key):
            raise ConfigError(f"override {item!r}: {key!r} is not a dotted key",
                              hint="keys look like group.field, e.g. parallelism.expert_model_parallel_size=2")
        try:
            conf = OmegaConf.from_dotlist([f"{key}={value}"])
            data = OmegaConf.to_container(conf, resolve=False)
        except Exception:
            # Not YAML (e.g. a pattern such as *E*E, which YAML reads as an alias): take the text
            # as a plain string; the type check still rejects it where a number or list is expected.
            data = {}
            node = data
            parts = key.split(".")
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = value
        merged = _merge(merged, data)  # type: ignore[arg-type]
    return merged


# --- checking names, types and choices -------------------------------------------------------
# fields a recipe may still carry that were replaced: dotted name -> what to write instead (one line)
RETIRED_FIELDS = {
    "rl.rollout.is_cap": "rl.is_max (rl.is_correction: tis, the default, truncates each token's importance "
                         "weight at it, with every engine; docs/rl.md)",
}


def _schema_children(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _check_keys(data: Any, cls: type, prefix: str, problems: list[str]) -> None:
    if not isinstance(data, dict):
        where = prefix[:-1] or "the recipe"
        problems.append(f"{where} must be a mapping of fields, got {data!r}")
        return
    children = _schema_children(cls)
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if dotted in RETIRED_FIELDS:
            problems.append(f"{dotted} was replaced by {RETIRED_FIELDS[dotted]}")
            continue
        if key not in children:
            close = difflib.get_close_matches(str(key), list(children), n=1, cutoff=0.6)
            # a field written at top level instead of inside its group
            owners = [n for n, _ in iter_fields() if n.endswith(f".{key}")] if not prefix else []
            if owners:
                suggestion = f" (did you mean '{owners[0]}'?)"
            elif close:
                suggestion = f" (did you mean '{prefix}{close[0]}'?)"
            else:
                suggestion = ""
            problems.append(f"unknown key {dotted!r}{suggestion}")
            continue
        typ = children[key]
        if dataclasses.is_dataclass(typ):
            _check_keys(value, typ, dotted + ".", problems)
        elif dotted == "model.architecture" and not isinstance(value, dict):
            problems.append(f"model.architecture must be a mapping of architecture fields, got {value!r}")
        elif dotted == "model.architecture":
            known = [f.name for f in dataclasses.fields(GptOssArch)]
            for akey in value:
                if akey not in known:
                    close = difflib.get_close_matches(str(akey), known, n=1, cutoff=0.6)
                    suggestion = f" (did you mean 'model.architecture.{close[0]}'?)" if close else ""
                    problems.append(f"unknown architecture field 'model.architecture.{akey}'{suggestion}")


def _check_choices(cfg: RecipeConfig) -> list[str]:
    problems = []
    for dotted, f in iter_fields():
        choices = f.metadata.get("choices")
        if not choices:
            continue
        value = _lookup(cfg, dotted)
        values = value if isinstance(value, list) else [value]
        for v in values:
            if v not in choices:
                named = [c for c in choices if c is not None]
                close = difflib.get_close_matches(str(v), [str(c) for c in named], n=1, cutoff=0.5)
                suggestion = f" (did you mean {close[0]!r}?)" if close else ""
                problems.append(
                    f"{dotted}={v!r} is not one of {' | '.join('null' if c is None else str(c) for c in choices)}"
                    f"{suggestion}"
                )
    return problems


def _lookup(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj


def _type_error(exc: OmegaConfBaseException, data: dict[str, Any]) -> str:
    key = getattr(exc, "full_key", None) or ""
    try:
        value = _lookup(data, key) if key else None
        shown = f"{key}={'null' if value is None else repr(value)}"
    except (KeyError, AttributeError, TypeError):
        shown = key or "recipe"
    expected = ""
    for dotted, f in iter_fields():
        if dotted == key:
            hint = typing.get_type_hints(_owner_class(key))[f.name]
            expected = f": expected {_type_name(hint)}"
            break
    if not expected:
        expected = f": {_first_line(exc)}"
    return f"{shown}{expected}"


def _owner_class(dotted: str) -> type:
    cls: type = RecipeConfig
    for part in dotted.split(".")[:-1]:
        cls = typing.get_type_hints(cls)[part]
    return cls


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if origin is typing.Union and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return f"{_type_name(inner[0])} or null"
    if origin in (list, typing.List):
        return f"a list of {_type_name(args[0]) if args else 'values'}"
    if origin in (dict, typing.Dict):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


# --- the model the recipe describes ---------------------------------------------------------
def architecture_from_checkpoint(checkpoint: str | Path) -> tuple[GptOssArch, str | None]:
    """(architecture, stored pattern or None) of any checkpoint folder the registry knows (Hybrid, HF,
    OpenAI original, a training run or iteration, Megatron torch_dist), read without torch; a file
    (its config.json or hybrid_config.json) stands for its folder."""
    path = Path(checkpoint).expanduser()
    if _is(path, "file"):
        path = path.parent
    elif not _is(path, "dir"):
        raise ConfigError(f"model.checkpoint={str(checkpoint)!r} does not exist",
                          hint="paths are relative to the working directory; or use model.preset instead")
    fmt = formats.detect(path)
    if fmt is None:
        raise ConfigError(f"model.checkpoint={str(checkpoint)!r} is no checkpoint gptoss reads (no hybrid_config.json, "
                          "config.json, training checkpoint or Megatron tracker in it)",
                          hint="point it at a `gptoss convert` output, a Hugging Face GPT-OSS folder, a checkpoint.dir "
                          "or a Megatron checkpoint")
    return fmt.architecture(path)


def resolve_model(cfg: RecipeConfig) -> tuple[GptOssArch, HybridPattern]:
    """The architecture (preset or checkpoint, then overrides) and the parsed layer pattern."""
    model = cfg.model
    if model.preset is not None and model.checkpoint is not None:
        raise ConfigError(
            f"model.preset={model.preset!r} and model.checkpoint={model.checkpoint!r} are both set",
            hint="keep one: the preset, or the checkpoint's own architecture (set model.preset=null)",
        )
    stored_pattern = None
    if model.checkpoint is not None:
        arch, stored_pattern = architecture_from_checkpoint(model.checkpoint)
    elif model.preset is not None:
        arch = PRESETS[model.preset]
    else:
        raise ConfigError("the recipe names no model: set model.preset or model.checkpoint",
                          hint=f"e.g. model.preset=tiny (presets: {', '.join(sorted(PRESETS))})")
    if model.architecture:
        blocks = model.architecture.get("num_hidden_layers")
        # checked before replace() builds the '*E' x blocks pattern string
        most = INT_LIMITS["num_hidden_layers"]
        if isinstance(blocks, int) and blocks > most:
            raise ConfigError(f"model.architecture.num_hidden_layers={blocks} is implausibly large (max {most})")
        try:
            arch = arch.replace(**model.architecture)
        except GptossError as exc:
            raise ConfigError(f"model.architecture: {exc.message}", hint=exc.hint) from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"model.architecture: {_first_line(exc)}") from None
    text = model.hybrid_layer_pattern or stored_pattern or arch.hybrid_layer_pattern
    return arch, parse_pattern(text)


# --- the entry point ------------------------------------------------------------------------
def load_recipe(ref: str | Path, overrides: Sequence[str] = (), *, recipes_dir: Path = RECIPES_DIR) -> Recipe:
    """Find, compose, override, type-check and resolve a recipe; ConfigError on anything malformed."""
    path = find_recipe(ref, recipes_dir)
    data, sources = _compose(path, recipes_dir=recipes_dir)
    over = parse_overrides(overrides)
    data = _merge(data, over)
    where = str(path) + (f" with overrides {list(overrides)}" if overrides else "")

    problems: list[str] = []
    _check_keys(data, RecipeConfig, "", problems)
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))

    schema = OmegaConf.structured(RecipeConfig)
    try:
        merged = OmegaConf.merge(schema, data)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{where}: {_type_error(exc, data)}") from None
    except (TypeError, ValueError) as exc:  # e.g. a list where the schema has a mapping
        raise ConfigError(f"{where}: {_first_line(exc)}") from None
    try:
        cfg: RecipeConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:  # interpolation errors, missing values
        key = getattr(exc, "full_key", "") or ""
        raise ConfigError(f"{where}: {key + ': ' if key else ''}{_first_line(exc)}") from None

    problems = _check_choices(cfg) + cfg.lora.pairing_problems()
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))
    if not cfg.name:
        cfg.name = path.stem
    arch, pattern = resolve_model(cfg)
    default_lora_targets(cfg, pattern)
    return Recipe(config=cfg, arch=arch, pattern=pattern, path=path, sources=tuple(sources),
                  overrides=tuple(overrides))


def default_lora_targets(cfg: RecipeConfig, pattern: HybridPattern) -> None:
    """A LoRA rank without targets adapts the usual ones: attention (linear_qkv, linear_proj) and, where
    the pattern has MoE or MLP layers, linear_fc1 / linear_fc2 (Megatron-Bridge's default, all four)."""
    lo = cfg.lora
    if lo.rank > 0 and not lo.target_modules:
        has_mlp = any(s in (MOE, MLP) for s in pattern.layers)
        lo.target_modules = [t for t in TARGET_MODULES if has_mlp or t not in MLP_TARGETS]


def recipe_from_config(cfg: RecipeConfig) -> Recipe:
    """A Recipe from a RecipeConfig built in code (tests, train's programmatic use)."""
    problems = _check_choices(cfg) + cfg.lora.pairing_problems()
    if problems:
        raise ConfigError("recipe: " + "; ".join(problems))
    arch, pattern = resolve_model(cfg)
    default_lora_targets(cfg, pattern)
    return Recipe(config=cfg, arch=arch, pattern=pattern, path=None, sources=(), overrides=())


__all__ = [
    "Recipe", "RECIPES_DIR", "available_recipes", "find_recipe", "load_recipe", "parse_overrides",
    "resolve_model", "architecture_from_checkpoint", "recipe_from_config", "default_lora_targets",
]
