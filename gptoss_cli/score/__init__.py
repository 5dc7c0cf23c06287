"""`gptoss score` and its file: a frozen model's per-token scores of a token file, and their reader for training.

compute.py (the label's log-prob, top-K and tail mass per position, through the chunked LM head),
files.py (the folder's format: manifest and shards), digests.py (data, model and tokenizer digests),
command.py (`score`, the command's library side, on `gptoss eval`'s rows), reader.py (`open_scores`:
checked against the run, looked up by a microbatch's trained-token numbers).
"""

from gptoss_cli.score.digests import checkpoint_digest, data_digest, tokenizer_digest
from gptoss_cli.score.reader import EXTRAS, MicrobatchScores, ScoreFile, open_scores

__all__ = ["open_scores", "ScoreFile", "MicrobatchScores", "EXTRAS", "checkpoint_digest", "data_digest",
           "tokenizer_digest"]
