"""minfer.server: the HTTP server behind `minfer serve`, around minfer.engine.core.

One request path, the server's own modules; each API surface is a sub-package translating onto
it, importing no other surface.

    app.py          the FastAPI app: lifespan, middleware, /health, /metrics, the model list
                    (/v1/models, OpenAI's or Anthropic's shape), llama-server's /tokenize,
                    /detokenize, /props, /apply-template
    schemas.py      the request bodies every surface translates into (pydantic; OpenAPI schema)
    prepare.py      body → GenRequest: prompt ids, limits, the sampler (needs the loaded model)
    output.py       per-request logit mask and final message (logit_bias, tools, grammars, the
                    reasoning split), token logprob entries
    relay.py        prepare, submit, then collect whole replies or stream them (SSE / NDJSON);
                    the client leaving cancels the request
    response_ids.py response ids carrying their conversation's chain (Ray routes by it)
    worker.py       the engine thread: drives the EngineCore (scheduling, batching, speculation,
                    per-request draws) and posts each request's events to its Handle
    state.py        settings, background model loading, /health status
    middleware.py   API key, body cap, request metrics; metrics.py the Prometheus registry
    errors.py       API error bodies; native.py llama.cpp's /completion and /infill;
                    embeddings.py and embed_worker.py the embedding routes and thread

    openai/        /v1/chat/completions, /v1/completions: routes.py, responses.py (bodies, chunks)
    anthropic/     /v1/messages; responses/ /v1/responses; ollama/ /api/*
    ray/           `minfer serve --ray`: deploy.py (Ray Serve app), router.py and affinity.py
                   (conversation → replica), sandbox.py (a loopback-only local cluster)
"""
