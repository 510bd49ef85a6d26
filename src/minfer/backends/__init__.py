"""minfer.backends."""
