"""Serving endpoints (gRPC, OpenAI HTTP). Filled in by the serving work."""
