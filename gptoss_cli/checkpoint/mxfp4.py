"""The MXFP4 codec as the checkpoint code knows it: the one implementation lives in gptoss_cli/model/mxfp4.py.

The model's quantisation-aware training rounds expert weights with the same functions
(`round_to_mxfp4` = decode(encode(.))), so the export and the forward cannot drift apart; model/
may not import checkpoint/, hence the codec's home there.
"""

from gptoss_cli.model.mxfp4 import E2M1_VALUES, GROUP, NonFiniteError, decode, encode, round_to_mxfp4

__all__ = ["E2M1_VALUES", "GROUP", "NonFiniteError", "decode", "encode", "round_to_mxfp4"]
