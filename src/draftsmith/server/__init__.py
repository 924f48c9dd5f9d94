"""OpenAI-compatible HTTP server: `create_app(llm)`, `serve(llm, host, port)`."""

from draftsmith.server.app import create_app, serve

__all__ = ["create_app", "serve"]
