"""Training, optimizer, data, checkpoints and system settings."""

from __future__ import annotations

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


@rule("data.source", "data.kind=tokens needs data.path; at launch the token files exist and fit the vocabulary",
      fix="data.path to a `gptoss prepare-data` output made with the model's tokenizer, or data.kind=mock "
          "(which ignores data.path: a warning)",
      severities=(ERROR, WARNING))
def data_source(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    d = cfg.data
    if d.kind == "mock":
        if d.path:
            return [warning({"data.kind": "mock", "data.path": d.path}, "data.path is ignored with mock data",
                            "set data.kind=tokens to train on the file")]
        return []
    if not d.path:
        return [error({"data.kind": "tokens", "data.path": None}, "token data needs a file",
                      "set data.path to a token file prefix (see `gptoss prepare-data`), or data.kind=mock")]
    if not ctx.check_paths:
        return []
    # Only at launch (train): the files are on the training machine, not necessarily here.
    from gptoss_cli.errors import GptossError  # noqa: PLC0415
    from gptoss_cli.data.token_format import check_token_files  # noqa: PLC0415

    try:
        check_token_files(d.path, ctx.arch.vocab_size)
    except GptossError as exc:
        return [error({"data.path": d.path}, exc.message, exc.hint or "create the files with `gptoss prepare-data`")]
    except (OSError, ValueError) as exc:  # unreadable, or a name the file system cannot hold
        return [error({"data.path": d.path}, f"token files for {d.path!r} cannot be read: {exc}",
                      "create the files with `gptoss prepare-data`")]
    return []


@rule("data.documents_fit", "at launch, every document of a packed (version-2) token file fits in training.seq_length",
      fix="training.seq_length >= the file's longest document (its header's max_document_length), or re-create the "
          "file with `gptoss prepare-data --max-length` <= seq_length")
def documents_fit(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    d = cfg.data
    if d.kind != "tokens" or not d.path or not ctx.check_paths:
        return []
    # Only at launch, like data.source (which reports unreadable or inconsistent files).
    import numpy as np  # noqa: PLC0415

    from gptoss_cli.data.token_format import INDEX_DTYPE, document_file_paths, has_documents, read_token_header  # noqa: PLC0415

    try:
        if not has_documents(read_token_header(d.path)):
            return []
        idx_path = document_file_paths(d.path)[0]
        offsets = np.fromfile(idx_path, dtype=INDEX_DTYPE)
    except Exception:  # noqa: BLE001 - data.source names what is wrong with the files
        return []
    if len(offsets) < 2:
        return []
    lengths = np.diff(offsets)
    longest = int(lengths.max())
    if longest <= cfg.training.seq_length:
        return []
    doc = int(lengths.argmax())
    return [error({"training.seq_length": cfg.training.seq_length, "data.path": d.path},
                  f"{idx_path}: document {doc} has {longest} tokens, more than a row of training.seq_length="
                  f"{cfg.training.seq_length} holds (documents are packed whole, never split)",
                  f"set training.seq_length >= {longest}, or re-create the file with a smaller --max-length")]


@rule("checkpoint.settings", "save_interval needs a checkpoint dir; at launch, pretrained weights exist",
      fix="set checkpoint.dir or checkpoint.save_interval=null; checkpoint.pretrained must exist (a `gptoss"
          " convert` output)")
def checkpoint_settings(cfg: RecipeConfig, ctx: Context) -> list[Finding]:
    c, out = cfg.checkpoint, []
    if c.save_interval is not None and not c.dir:
        out.append(error({"checkpoint.save_interval": c.save_interval, "checkpoint.dir": None},
                         "save_interval is set but there is no checkpoint directory",
                         "set checkpoint.dir, or checkpoint.save_interval=null"))
    if ctx.check_paths and c.pretrained:
        from pathlib import Path  # noqa: PLC0415

        try:
            exists = Path(c.pretrained).expanduser().exists()
        except (OSError, ValueError):  # a name the file system cannot hold
            exists = False
        if not exists:
            out.append(error({"checkpoint.pretrained": c.pretrained},
                             f"pretrained weights {c.pretrained!r} do not exist",
                             "convert them first (`gptoss convert`) or fix the path"))
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
