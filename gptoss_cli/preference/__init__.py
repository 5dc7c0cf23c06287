"""Preference tuning (objective.kind=dpo, docs/dpo.md): DPO and its variants on harmony preference pairs."""
