"""Ollama's API (`/api/tags`, `/api/show`, `/api/chat`, `/api/generate`, `/api/ps`, …)."""
