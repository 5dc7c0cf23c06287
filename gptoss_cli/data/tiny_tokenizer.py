"""A small byte-level BPE tokenizer.json with harmony's special tokens, for tiny models (`gptoss make-tiny`).

With it prepare-data (text and `--format harmony`), train, eval and generate run on a tiny model
without downloading the GPT-OSS tokenizer. It is the GPT-OSS tokenizer's kind, not its vocabulary:
- ids 0-255: the 256 bytes, in the byte-level alphabet (GPT-2's bytes_to_unicode), so any text
  encodes and decodes exactly;
- then merges that spell out, whole, the words harmony's formatting writes and a few common ones
  (with and without a leading space), so a rendered conversation is not one token per character;
- harmony's special tokens at the top of the vocabulary, ending with `<|endoftext|>` at the tiny
  preset's pad id and `<|return|>` at its EOS id, as GPT-OSS pairs them (199999 and 200002), and
  reserved special tokens in between, so the ids are exactly the model's vocabulary.
Written as plain JSON: no `tokenizers` package is needed to make it (prepare-data needs it to read it).
"""

from __future__ import annotations

from typing import Any

# harmony's special tokens, in GPT-OSS's id order; the last two are the pad and the EOS token
SPECIAL = ("<|startoftext|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>",
           "<|endoftext|>", "<|return|>")
# harmony's header words (roles, channels, the default system message) and a few common words
WORDS = (
    "system", "developer", "user", "assistant", "tool", "analysis", "commentary", "final", "functions",
    "You", "are", "ChatGPT", "large", "language", "model", "trained", "by", "OpenAI", "Knowledge", "cutoff",
    "Current", "date", "Reasoning", "medium", "low", "high", "Valid", "channels", "Channel", "must", "be",
    "included", "for", "every", "message", "the", "and", "to", "of", "is", "in", "it", "that", "what", "The",
    "answer", "question", "Hello", "hello", "Hi", "How", "you", "can", "help", "today", "Thanks", "please",
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character (what ByteLevel pre-tokenizes to)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def tiny_tokenizer(vocab_size: int) -> dict[str, Any]:
    """The tokenizer.json document for a model of `vocab_size` ids (at least 256 + len(SPECIAL))."""
    if vocab_size < 256 + len(SPECIAL):
        raise ValueError(f"a byte-level tokenizer with harmony's tokens needs vocab_size >= {256 + len(SPECIAL)}, "
                         f"not {vocab_size}")
    alphabet = bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    merges: list[list[str]] = []
    budget = vocab_size - len(SPECIAL)
    for word in WORDS:
        for spelled in (word, " " + word):
            text = "".join(alphabet[b] for b in spelled.encode("utf-8"))
            for end in range(2, len(text) + 1):
                if text[:end] in vocab:
                    continue
                if len(vocab) >= budget:
                    break
                merges.append([text[:end - 1], text[end - 1]])
                vocab[text[:end]] = len(vocab)
    first_special = vocab_size - len(SPECIAL)
    # ids between the merges and harmony's tokens are reserved special tokens (GPT-OSS has them too),
    # so the vocabulary is contiguous: vocab_size ids, the model's
    specials = [f"<|reserved_{i}|>" for i in range(len(vocab), first_special)] + list(SPECIAL)
    vocab.update({t: len(vocab) + i for i, t in enumerate(specials)})
    added = [{"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for t in specials]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


__all__ = ["tiny_tokenizer", "bytes_to_unicode", "SPECIAL", "WORDS"]
