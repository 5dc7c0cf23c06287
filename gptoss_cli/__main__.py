"""`python -m gptoss_cli` runs the CLI (used where the console script is not on PATH)."""

from gptoss_cli.cli import main

main()
