"""Training: the loop, what it reads and writes, and what reads that back as training computes it.

- what a run is handed: job.py (`TrainJob`, what a worker is handed), heartbeat.py (per-step
  heartbeats and the watchdog);
- the loop: loop.py (`Trainer`: build, resume, train_step, record, save), objective.py (what a step
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

Launching a run (`gptoss train`'s library entry, the workers, the table from `objective.kind` to its
objective and Trainer) lives above this package and the ones that build on the loop (rl/), in
gptoss_cli/run/; this package never imports them. prepare-data's library side (tokenizing into
token files) lives in gptoss_cli/data/.
"""
