"""Distillation (objective.kind=distill, docs/distill.md): a frozen teacher's distributions taught to the student.

losses.py (the divergences: forward KL, reverse KL, the generalised JSD, on the full vocabulary or the
teacher's top-K and tail), teacher.py (where the teacher comes from: a `gptoss score` folder, or a frozen
checkpoint of its own architecture beside the student), objective.py (the offline objective on the data
section's token files), on_policy.py (on the student's own samples: GRPO's rollouts, the teacher scoring
the sampled tokens), trainer.py (the Trainer each mode runs with: objective.kind=distill's row in
gptoss_cli/run/objectives.py).
"""
