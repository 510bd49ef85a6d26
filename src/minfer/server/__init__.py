"""minfer.server: the OpenAI-compatible HTTP server behind `minfer serve`.

    schemas.py     request bodies (pydantic; also the OpenAPI schema)
    prepare.py     body → GenRequest: prompt ids, limits, the sampler (needs the loaded model)
    structured.py  per-request logit mask and final-message hook (logit_bias; later grammars)
    worker.py      the engine thread: drives minfer.engine.core's EngineCore (scheduling,
                   batching, speculation, per-request draws), posts events to the HTTP side
    state.py       settings, background model loading, /health status
    app.py         FastAPI routes; responses.py the OpenAI bodies and chunks
    middleware.py  API key, body cap, request metrics; metrics.py the Prometheus text
    errors.py      OpenAI-style error bodies; fake.py a kernel-free engine for tests
"""
