"""minfer.tokenizer."""
