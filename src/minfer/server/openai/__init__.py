"""minfer.server.openai: the OpenAI-compatible surface (chat / completion routes, their bodies
and chunks); the request bodies themselves are the server's own (minfer.server.schemas)."""
