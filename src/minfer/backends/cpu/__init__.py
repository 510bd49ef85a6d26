"""minfer.backends.cpu."""
