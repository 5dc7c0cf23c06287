"""A training run put together: the composition root of `gptoss train`, above train/ and rl/.

- objectives.py: the one table from a recipe's `objective.kind` to its training objective and its
  Trainer (cross-entropy and the loop's own Trainer from train/, GRPO and its Trainer from rl/);
- worker.py: `run_worker`, a rank's entry: the process group, heartbeat and loggers, then the
  Trainer of the recipe's objective;
- launch.py: `train`, `gptoss train`'s library entry: the recipe checked with the shared rules, the
  run's folders locked, then the workers started (elastic launcher) or trained in this process.

train/ (the loop, what it reads and writes) and the packages that build on it (rl/) never import
this package; it is the one place that names them together.
"""
