"""minfer.server.openai: the OpenAI-compatible surface (bodies, routes, responses)."""
