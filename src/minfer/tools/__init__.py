"""minfer.tools."""
