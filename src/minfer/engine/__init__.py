"""minfer.engine."""
