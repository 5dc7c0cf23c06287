"""`gptoss prepare-data`'s library side: files in, token files out, one writer module per `--format`.

formats.py (the table of formats, the options each takes, the entry the command calls), result.py (the one
result every format returns), text.py (text and JSONL into token streams, version 1), conversations.py
(harmony conversations with a loss mask, version 2), preference.py (preference pairs: both sides in harmony,
two documents a pair, version 2). The token file format itself is data/token_format.py.
"""
