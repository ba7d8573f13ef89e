"""`mlx-spec serve`: an OpenAI- and Anthropic-compatible HTTP server over `stream_generate`.

    engine = Engine(model, tokenizer, drafter, model_id="my-model").start()
    app = create_app(engine, api_key=None)      # a Starlette (ASGI) app
    Server(app, engine, port=8080).run()        # uvicorn

`engine` (one thread for all MLX work, a FIFO queue, the prompt cache, the
counters), `events` (a request and what comes back for it), `link` (a sharded
target's ranks kept in step by rank 0's per-step plan), `openai` / `anthropic`
(request parsing and response shapes),
`text` (stop strings, reasoning and tool calls), `app` (routes, errors, the
API key). Importing this package imports nothing heavy; the HTTP modules need
the `server` extra.
"""
