"""Training, optimizer, data, checkpoints and system settings."""

from __future__ import annotations

import dataclasses
import math

from gptoss_cli.model.config import NON_ARCHITECTURAL
from gptoss_cli.recipe.rules.core import ERROR, WARNING, Context, Finding, error, rule, warning
from gptoss_cli.recipe.schema import RecipeConfig


# --- training, optimizer, data, checkpoints, system ------------------------------------------------
@rule("training.lr_schedule", "min_lr <= lr, warmup_iters <= train_iters, lr_decay_iters >= warmup_iters",
      fix="training.min_lr <= lr, warmup_iters <= train_iters, lr_decay_iters >= warmup_iters")
def lr_schedule(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    t, out = cfg.training, []
    if t.min_lr > t.lr:
        out.append(error({"training.lr": t.lr, "training.min_lr": t.min_lr},
                         f"min_lr={t.min_lr} is above the peak lr={t.lr}", "set training.min_lr <= training.lr"))
    if t.warmup_iters > t.train_iters:
        out.append(error({"training.warmup_iters": t.warmup_iters, "training.train_iters": t.train_iters},
                         f"warmup_iters={t.warmup_iters} is longer than the run ({t.train_iters} steps)",
                         "set training.warmup_iters <= training.train_iters"))
    decay = t.lr_decay_iters if t.lr_decay_iters is not None else t.train_iters
    if t.lr_decay_style != "constant" and decay < t.warmup_iters:
        out.append(error({"training.lr_decay_iters": decay, "training.warmup_iters": t.warmup_iters},
                         f"lr decay ends (step {decay}) before warm-up does (step {t.warmup_iters})",
                         "set training.lr_decay_iters >= training.warmup_iters"))
    return out


@rule("optimizer.betas", "AdamW betas in [0, 1)",
      fix="betas in [0, 1), typically optimizer.adam_beta1=0.9 optimizer.adam_beta2=0.95")
def adam_betas(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    o = cfg.optimizer
    bad = {f"optimizer.{k}": v for k, v in (("adam_beta1", o.adam_beta1), ("adam_beta2", o.adam_beta2))
           if not 0.0 <= v < 1.0}
    if not bad:
        return []
    return [error(bad, f"AdamW betas must lie in [0, 1): {bad}", "typical values: adam_beta1=0.9 adam_beta2=0.95")]


@rule("optimizer.param_gather", "overlap_param_gather needs the distributed optimizer and overlap_grad_reduce",
      fix="set optimizer.use_distributed_optimizer=true overlap.overlap_grad_reduce=true, "
          "or overlap.overlap_param_gather=false")
def param_gather(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    o, ov = cfg.optimizer, cfg.overlap
    if not ov.overlap_param_gather or (o.use_distributed_optimizer and ov.overlap_grad_reduce):
        return []
    return [error({"overlap.overlap_param_gather": True, "optimizer.use_distributed_optimizer": o.use_distributed_optimizer,
                   "overlap.overlap_grad_reduce": ov.overlap_grad_reduce},
                  "overlap_param_gather overlaps the distributed optimizer's all-gather and needs "
                  "use_distributed_optimizer and overlap_grad_reduce")]


def token_files(cfg: RecipeConfig) -> list[tuple[str, str]]:
    """(field, prefix) of every token file the recipe trains or validates on: data.path or each
    data.blend entry (kind=tokens), and validation.data."""
    d, out = cfg.data, []
    if d.kind == "tokens":
        if d.path:
            out.append(("data.path", d.path))
        out += [(f"data.blend[{i}].path", b.path) for i, b in enumerate(d.blend) if b.path]
    if cfg.validation.data:
        out.append(("validation.data", cfg.validation.data))
    return out


def _blend_problems(cfg: RecipeConfig) -> list[Finding]:
    d, out = cfg.data, []
    if d.path and d.blend:
        out.append(error({"data.path": d.path, "data.blend": len(d.blend)},
                         "data.path and data.blend both name training data", "keep one: data.path or data.blend"))
    for i, b in enumerate(d.blend):
        if not b.path:
            out.append(error({f"data.blend[{i}].path": ""}, f"data.blend[{i}] has no path",
                             "give every blend entry a token file prefix: {path: PREFIX, weight: W}"))
        if not (math.isfinite(b.weight) and b.weight > 0):
            out.append(error({f"data.blend[{i}].weight": b.weight},
                             f"data.blend[{i}].weight={b.weight} must be a finite number above 0",
                             "give every blend entry a positive weight (they are normalised)"))
    return out


@rule("data.source", "data.kind=tokens needs data.path or data.blend (positive weights); at launch every token "
      "file exists and fits the vocabulary",
      fix="data.path (or data.blend) to `gptoss prepare-data` outputs made with the model's tokenizer, or "
          "data.kind=mock (which ignores data.path: a warning)",
      severities=(ERROR, WARNING))
def data_source(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    d = cfg.data
    if d.kind == "mock":
        if d.path or d.blend:
            what = "data.path" if d.path else "data.blend"
            return [warning({"data.kind": "mock", what: d.path or len(d.blend)}, f"{what} is ignored with mock data",
                            "set data.kind=tokens to train on the files")]
        return []
    if not d.path and not d.blend:
        return [error({"data.kind": "tokens", "data.path": None}, "token data needs a file",
                      "set data.path to a token file prefix (see `gptoss prepare-data`), or data.kind=mock")]
    out = _blend_problems(cfg)
    if ctx.check_paths and not out:
        out += _launch_file_problems([f for f in token_files(cfg) if f[0] != "validation.data"], ctx)
    return out


def _launch_file_problems(files: list[tuple[str, str]], ctx: Context) -> list[Finding]:
    """Only at launch (train): the files are on the training machine, not necessarily here. A missing
    or unreadable file is bad input (exit 2)."""
    from gptoss_cli.errors import GptossError  # noqa: PLC0415
    from gptoss_cli.data.token_format import check_token_files  # noqa: PLC0415

    out = []
    for name, path in files:
        try:
            check_token_files(path, ctx.arch.vocab_size)
        except GptossError as exc:
            out.append(error({name: path}, f"{name}: {exc.message}",
                             exc.hint or "create the files with `gptoss prepare-data`", bad_input=True))
        except (OSError, ValueError) as exc:  # unreadable, or a name the file system cannot hold
            out.append(error({name: path}, f"{name}: token files for {path!r} cannot be read: {exc}",
                             "create the files with `gptoss prepare-data`", bad_input=True))
    return out


@rule("validation.source", "validation.interval and validation.iters need validation.data; at launch its token "
      "file exists and fits the vocabulary",
      fix="validation.data to a held-out `gptoss prepare-data` output, or validation.interval=null "
          "validation.iters=null", severities=(ERROR, WARNING))
def validation_source(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    v = cfg.validation
    if not v.data:
        stray = {f"validation.{k}": getattr(v, k) for k in ("interval", "iters") if getattr(v, k) is not None}
        if stray:
            return [warning(stray, f"{', '.join(stray)} set without validation.data: nothing is validated",
                            "set validation.data to a held-out token file")]
        return []
    return _launch_file_problems([("validation.data", v.data)], ctx) if ctx.check_paths else []


@rule("data.documents_fit", "at launch, every document of a packed (version-2) token file fits in training.seq_length",
      fix="training.seq_length >= the file's longest document (its header's max_document_length), or re-create the "
          "file with `gptoss prepare-data --max-length` <= seq_length")
def documents_fit(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    if not ctx.check_paths:
        return []
    # Only at launch, like data.source (which reports unreadable or inconsistent files).
    out = []
    for name, path in token_files(cfg):
        longest = _longest_document(path)
        if longest is not None and longest[0] > cfg.training.seq_length:
            tokens, doc, idx_path = longest
            out.append(error({"training.seq_length": cfg.training.seq_length, name: path},
                             f"{idx_path}: document {doc} has {tokens} tokens, more than a row of training.seq_length="
                             f"{cfg.training.seq_length} holds (documents are packed whole, never split)",
                             f"set training.seq_length >= {tokens}, or re-create the file with a smaller --max-length"))
    return out


def _longest_document(path: str) -> tuple[int, int, str] | None:
    """(tokens, index, index file) of a version-2 file's longest document; None for version 1 or
    unreadable files (data.source names what is wrong with those)."""
    import numpy as np  # noqa: PLC0415

    from gptoss_cli.data.token_format import INDEX_DTYPE, document_file_paths, has_documents, read_token_header  # noqa: PLC0415

    try:
        if not has_documents(read_token_header(path)):
            return None
        idx_path = document_file_paths(path)[0]
        offsets = np.fromfile(idx_path, dtype=INDEX_DTYPE)
    except Exception:  # noqa: BLE001 - data.source names what is wrong with the files
        return None
    if len(offsets) < 2:
        return None
    lengths = np.diff(offsets)
    return int(lengths.max()), int(lengths.argmax()), str(idx_path)


@rule("checkpoint.settings", "without a checkpoint dir no checkpoint is saved (save_interval, keep_last and "
      "keep_every have nothing to act on: a warning); at launch, pretrained weights exist and their architecture is "
      "the recipe's",
      fix="checkpoint.dir=null turns checkpoints off; set checkpoint.dir to save them. checkpoint.pretrained must "
          "exist (`gptoss make-tiny` for the tiny preset, else a `gptoss convert` output) and match model.*",
      severities=(ERROR, WARNING))
def checkpoint_settings(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    c, out = cfg.checkpoint, []
    moot = {f"checkpoint.{name}": getattr(c, name) for name in ("save_interval", "keep_last", "keep_every")
            if getattr(c, name) is not None}
    if moot and not c.dir:
        out.append(warning({**moot, "checkpoint.dir": None},
                           f"checkpoint.dir is null: this run saves no checkpoint ({', '.join(moot)} "
                           f"{'has' if len(moot) == 1 else 'have'} nothing to act on)",
                           "set checkpoint.dir to save checkpoints"))
    if ctx.check_paths and c.pretrained:
        out += _pretrained_problems(c.pretrained, ctx, tiny=cfg.model.preset == "tiny")
    return out


def _pretrained_problems(pretrained: str, ctx: Context, tiny: bool = False) -> list[Finding]:
    """The pretrained weights exist (else bad input) and hold the recipe's architecture: a mismatch
    would otherwise surface in every worker as a shape error after the launch."""
    from pathlib import Path  # noqa: PLC0415

    from gptoss_cli.errors import GptossError  # noqa: PLC0415
    from gptoss_cli.recipe.load import architecture_from_checkpoint  # noqa: PLC0415

    try:
        exists = Path(pretrained).expanduser().exists()
    except (OSError, ValueError):  # a name the file system cannot hold
        exists = False
    if not exists:
        make = (f"create them with `gptoss make-tiny {pretrained}`" if tiny
                else "convert them first (`gptoss convert`)")
        return [error({"checkpoint.pretrained": pretrained}, f"pretrained weights {pretrained!r} do not exist",
                      f"{make}, or fix the path", bad_input=True)]
    try:
        arch, _ = architecture_from_checkpoint(pretrained)
    except GptossError:  # a kind the recipe reader does not know: the loader in the workers judges it
        return []
    differ = [(f.name, getattr(arch, f.name), getattr(ctx.arch, f.name)) for f in dataclasses.fields(arch)
              if f.name not in NON_ARCHITECTURAL and getattr(arch, f.name) != getattr(ctx.arch, f.name)]
    if not differ:
        return []
    name, theirs, ours = differ[0]
    more = f" (and {len(differ) - 1} more field{'s' * (len(differ) > 2)})" if len(differ) > 1 else ""
    return [error({"checkpoint.pretrained": pretrained, f"model.architecture.{name}": ours},
                  f"checkpoint.pretrained {pretrained} has {name}={theirs}, the recipe's model has {name}={ours}{more}",
                  f"set model.checkpoint={pretrained} to take the architecture from the weights, or pretrained "
                  "weights of the recipe's model")]


@rule("checkpoint.retention", "checkpoint.keep_every works with checkpoint.keep_last (alone it deletes nothing)",
      fix="set checkpoint.keep_last as well, or checkpoint.keep_every=null", severities=(WARNING,))
def checkpoint_retention(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    c = cfg.checkpoint
    if c.keep_every is not None and c.keep_last is None:
        return [warning({"checkpoint.keep_every": c.keep_every, "checkpoint.keep_last": None},
                        "checkpoint.keep_every without keep_last: every checkpoint is kept anyway")]
    return []


@rule("checkpoint.async_save", "checkpoint.async_save saves into checkpoint.dir (without one it has nothing to do: "
      "a warning); its staged copy is host memory, which the memory estimate counts per rank",
      fix="set checkpoint.dir, or checkpoint.async_save=false", severities=(WARNING,))
def checkpoint_async_save(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    c = cfg.checkpoint
    if c.async_save and not c.dir:
        return [warning({"checkpoint.async_save": True, "checkpoint.dir": None},
                        "checkpoint.async_save without checkpoint.dir: this run saves no checkpoint")]
    return []


@rule("checkpoint.save_on_signal", "checkpoint.save_on_signal saves into checkpoint.dir (without one a signal stops "
      "the run at once, as without the field: a warning); under GRPO a signal inside a rollout of "
      "rl.steps_per_rollout steps trains to the rollout's end before the save (a warning: the scheduler's grace "
      "period must cover those steps)",
      fix="set checkpoint.dir; with GRPO, rl.steps_per_rollout=1 saves after the step the signal arrives in",
      severities=(WARNING,))
def checkpoint_save_on_signal(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    c, out = cfg.checkpoint, []
    if not c.save_on_signal:
        return out
    if not c.dir:
        out.append(warning({"checkpoint.save_on_signal": True, "checkpoint.dir": None},
                           "checkpoint.save_on_signal without checkpoint.dir: a signal stops the run at once and "
                           "nothing is saved"))
    elif cfg.objective.kind == "grpo" and cfg.rl.steps_per_rollout > 1:
        out.append(warning({"checkpoint.save_on_signal": True, "rl.steps_per_rollout": cfg.rl.steps_per_rollout},
                           f"a signal inside a rollout trains up to {cfg.rl.steps_per_rollout - 1} more steps (to the "
                           "rollout's end, where GRPO checkpoints fall) before the save"))
    return out


@rule("system.backend", "the distributed backend suits the device (nccl needs cuda)",
      fix="parallelism.backend=auto (nccl on CUDA, gloo on the CPU); gloo on GPUs is a warning",
      severities=(ERROR, WARNING))
def system_backend(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    dev, be = cfg.system.device, cfg.parallelism.backend
    if dev == "cpu" and be == "nccl":
        return [error({"system.device": "cpu", "parallelism.backend": "nccl"}, "nccl cannot run on the CPU",
                      "set parallelism.backend=gloo (or auto)")]
    if dev == "cuda" and be == "gloo":
        return [warning({"system.device": "cuda", "parallelism.backend": "gloo"},
                        "gloo on GPUs copies every collective through the host", "set parallelism.backend=nccl (or auto)")]
    return []
