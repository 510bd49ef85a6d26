"""minfer.server."""
