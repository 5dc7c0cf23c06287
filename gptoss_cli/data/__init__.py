"""Training data that needs more than a token stream: conversations rendered in harmony, packing of documents, the tokenizer file."""
