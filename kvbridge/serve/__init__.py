"""`python -m kvbridge serve` (issue 13): an OpenAI-compatible endpoint with KVBridge's cache behind it.

Modules, in reading order: protocol (OpenAI's request and response shapes, errors), engines (the
scheduler or CachedEngine over llama-server, as jobs an event loop waits on), metrics (Prometheus),
guards (what a request must pass first: its Host, key, Content-Type and size), app (the Starlette
routes), server (uvicorn, the ready line, the keyless-bind refusal, SIGTERM drain).
"""
