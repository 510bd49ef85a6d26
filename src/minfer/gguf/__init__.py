"""minfer.gguf."""
