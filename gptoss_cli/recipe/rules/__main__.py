"""Print the rule table (`python -m gptoss_cli.recipe.rules`), or regenerate every generated table in docs/.

    python -m gptoss_cli.recipe.rules                # the rule table as markdown
    python -m gptoss_cli.recipe.rules --fields       # the recipe-field table
    python -m gptoss_cli.recipe.rules --write        # rewrite docs/rules.md and docs/recipes.md in place
    python -m gptoss_cli.recipe.rules --write FILE   # rewrite the generated blocks FILE holds
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gptoss_cli.outputs import replace_text
from gptoss_cli.recipe.rules.docs import fields_markdown, home_files, rules_markdown, update_blocks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gptoss_cli.recipe.rules", description=__doc__.splitlines()[0])
    parser.add_argument("--fields", action="store_true", help="print the recipe-field table instead")
    parser.add_argument("--write", type=Path, nargs="*", metavar="FILE",
                        help="regenerate the marked blocks of these files (default: docs/rules.md and docs/recipes.md)")
    args = parser.parse_args(argv)
    if args.write is None:
        sys.stdout.write(fields_markdown() if args.fields else rules_markdown())
        return 0
    for path in args.write or home_files():
        try:
            text = path.read_text()
            new = update_blocks(text)
            if new != text:
                replace_text(path, new)
        except (OSError, ValueError) as exc:
            print(f"error: {path}: {exc}", file=sys.stderr)
            return 2
        print(f"{path}: {'updated' if new != text else 'already up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
