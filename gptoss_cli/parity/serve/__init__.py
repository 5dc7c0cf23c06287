"""`gptoss serve-check`: the command (check.py), its prompts (prompts.py), gptoss's side and the
near-tie flips (reference.py), the error budget (budget.py), what the engine loads (export.py), and
the comparison and report (report.py)."""
