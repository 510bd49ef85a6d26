"""minfer.server: the HTTP server behind `minfer serve`, around minfer.engine.core.

    app.py         the FastAPI app: lifespan, middleware, /health, /metrics, /tokenize, /detokenize
    worker.py      the engine thread: drives the EngineCore (scheduling, batching, speculation,
                   per-request draws) and posts each request's events to its Handle
    state.py       settings, background model loading, /health status
    middleware.py  API key, body cap, request metrics; metrics.py the Prometheus text
    errors.py      API error bodies; fake.py a kernel-free engine for tests

    openai/        the OpenAI-compatible surface
        schemas.py     request bodies (pydantic; also the OpenAPI schema)
        prepare.py     body → GenRequest: prompt ids, limits, the sampler (needs the loaded model)
        structured.py  per-request logit mask and final-message hook (logit_bias, tools, grammars)
        routes.py      /v1/chat/completions, /v1/completions, /v1/models
        responses.py   the OpenAI bodies and chunks
    ray/           `minfer serve --ray`: deploy.py (Ray Serve app), router.py and affinity.py
                   (conversation → replica), sandbox.py (a loopback-only local cluster)
"""
