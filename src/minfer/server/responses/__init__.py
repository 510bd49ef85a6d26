"""OpenAI's Responses API (`POST /v1/responses`), translated onto the chat request path."""
