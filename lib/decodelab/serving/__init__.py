"""The OpenAI-compatible server on the engine (`python -m decodelab serve`): `protocol` (requests in,
SamplingParams out, the error shape), `responses` (answers, chunks, server-sent events),
`engine_loop` (the one thread that owns the LLM, and its inbox), `client_request` (a request's side:
its updates on an asyncio queue), `metrics` (Prometheus text), `app` (the routes), `server` (binding
and uvicorn). Imports engine and below; needs fastapi and uvicorn (the `serve` extra)."""
