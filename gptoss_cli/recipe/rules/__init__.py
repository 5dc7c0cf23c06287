"""The rule registry that validate-config, train's pre-flight check and docs/rules.md's rule list share.

`core.py` holds the machinery (findings, the `rule` decorator, the context); each other module
registers the rules of one area, in the order they run: field bounds (the gate), the model,
parallel arithmetic and MoE, EP overlap, CUDA graphs and recompute, precision, training, LoRA, the
end-of-run serve check, reinforcement learning (GRPO), preference tuning (DPO), distillation, memory per GPU, and the table of options gptoss does not implement yet.
"""

from gptoss_cli.recipe.rules.core import (  # noqa: F401
    ERROR, IMPLEMENTED, RULES, SEMANTIC, UNSUPPORTED, WARNING, Context, Finding, Rule, error,
    list_rules, rule, warning,
)
from gptoss_cli.recipe.rules import fields, model, parallel, overlap, graphs, precision, training  # noqa: F401,E402
from gptoss_cli.recipe.rules import lora  # noqa: F401,E402
from gptoss_cli.recipe.rules import serve_check  # noqa: F401,E402
from gptoss_cli.recipe.rules import rl  # noqa: F401,E402
from gptoss_cli.recipe.rules import dpo  # noqa: F401,E402
from gptoss_cli.recipe.rules import distill  # noqa: F401,E402
from gptoss_cli.recipe.rules import memory  # noqa: F401,E402
from gptoss_cli.recipe.rules import unsupported  # noqa: F401,E402  (registers last: unsupported.* after semantics)

__all__ = [
    "Finding", "Rule", "Context", "RULES", "rule", "list_rules", "error", "warning", "IMPLEMENTED",
    "ERROR", "WARNING", "SEMANTIC", "UNSUPPORTED",
]
