"""Pooling models (embeddings, cross-encoder scores): what they are, how their requests are
batched and run, and the async front the HTTP server uses. See docs/architecture.md, "Pooling
models"."""
