"""minfer.bench."""
