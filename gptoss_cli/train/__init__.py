"""Training: the loop, what it reads and writes, and what reads that back as training computes it.

- launching: launch.py (validate, lock the folders, start the workers), job.py (`TrainJob`, what a
  worker is handed), heartbeat.py (per-step heartbeats and the watchdog);
- the loop: worker.py (`run_worker`; where the recipe's objective kind picks its objective and
  Trainer), loop.py (`Trainer`: build, resume, train_step, record, save), objective.py (what a step
  computes from its batch: the training-objective seam), setup.py and provider.py (the
  rank's model and optimizer), optimizer.py (distributed AdamW, the lr schedule), resume.py (what a
  resume must agree with);
- its data: data.py (mock and token-file sources, packing, sharding by rank);
- its checkpoints: checkpointing.py (DCP checkpoints with `latest`);
- its metrics: telemetry.py (one step's loss terms and router statistics), metrics.py
  (metrics.jsonl), loggers.py (TensorBoard / W&B), progress.py (typed progress events, the result);
- read back as training computes it: evaluate.py (`gptoss eval`: held-out loss over the trained
  tokens, with training's data sources and EP layout) and report.py (`gptoss report`: the run's
  metrics.jsonl summarised and plotted; torch-free).

prepare-data's library side (tokenizing into token files) lives in gptoss_cli/data/, not here.
"""
