"""Print the README's rule table (`python -m gptoss_cli.recipe.rules`), or regenerate README.md's blocks.

    python -m gptoss_cli.recipe.rules                  # the rule table as markdown
    python -m gptoss_cli.recipe.rules --fields         # the recipe-field table
    python -m gptoss_cli.recipe.rules --write README.md  # rewrite both blocks of README.md in place
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gptoss_cli.recipe.rules.docs import fields_markdown, rules_markdown, update_readme


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gptoss_cli.recipe.rules", description=__doc__.splitlines()[0])
    parser.add_argument("--fields", action="store_true", help="print the recipe-field table instead")
    parser.add_argument("--write", type=Path, metavar="README", help="regenerate the marked blocks of this file")
    args = parser.parse_args(argv)
    if args.write is None:
        sys.stdout.write(fields_markdown() if args.fields else rules_markdown())
        return 0
    try:
        text = args.write.read_text()
        new = update_readme(text)
    except (OSError, ValueError) as exc:
        print(f"error: {args.write}: {exc}", file=sys.stderr)
        return 2
    if new != text:
        tmp = args.write.with_name(f".{args.write.name}.tmp-{os.getpid()}")
        tmp.write_text(new)
        os.replace(tmp, args.write)
    print(f"{args.write}: {'updated' if new != text else 'already up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
