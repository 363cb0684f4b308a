"""The OpenAI-compatible HTTP server (`python -m model_server serve`)."""
