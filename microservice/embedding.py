"""`python -m microservice.embedding`: the embedding microservice (EMBEDDING_* settings)."""

from __future__ import annotations


def main() -> int:
    import logging

    import uvicorn

    from microservice.pooling_app import build_embedding_app
    from microservice.pooling_settings import EmbeddingSettings

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = EmbeddingSettings()
    app = build_embedding_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_config=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
