"""Serving endpoints for jaxserve: gRPC (jaxserve.v1, KServe v2 / Triton, health, reflection) and OpenAI HTTP.

    service.async_engine  ServingEngine: admission, readiness, drain, metrics around one jaxserve.AsyncLLM
    service.grpc_server   jaxserve.v1 Generation + health + reflection + API-key interceptor
    service.kserve        inference.GRPCInferenceService (KServe v2 with Triton's LLM tensor conventions)
    service.http_server   /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics
    service.server        both servers on one event loop; `jaxserve serve` runs service.server.serve
    service.cli           the `jaxserve` command: jaxserve.cli's `generate` plus `serve` (`python -m service serve`)
    service.proto         .proto sources and the stubs scripts/gen_protos.sh generates from them
"""
