"""minfer.models."""
