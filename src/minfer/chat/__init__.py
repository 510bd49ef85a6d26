"""minfer.chat."""
