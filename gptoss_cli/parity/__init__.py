"""Parity: weight round trip and block-streamed forward comparison against transformers."""

from gptoss_cli.parity.check import run_parity  # noqa: F401
from gptoss_cli.parity.report import ParityReport, Thresholds  # noqa: F401
