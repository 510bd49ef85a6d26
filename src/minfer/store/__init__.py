"""minfer.store."""
