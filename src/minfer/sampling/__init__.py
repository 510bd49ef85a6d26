"""minfer.sampling."""
