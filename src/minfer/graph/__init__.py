"""minfer.graph."""
