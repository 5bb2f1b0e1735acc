"""The OpenAI-compatible HTTP gateway: its own supervised process, a client of the
daemon's ZeroMQ socket through `hybridd.AsyncClient`.

`openai_schema` reads and checks the request bodies, `openai_output` writes the
responses, `tool_calls` plans a chat's tools, `tool_call_reader` reads the model's calls
out of its text as it streams (with `json_rewriter` writing their arguments), `errors`
speaks OpenAI's error format, `api_keys` reads the keys, `app` holds the routes,
`exchange` is one generation route's HTTP exchange in raw ASGI, `process` runs the HTTP
servers (the API and, without it, a metrics endpoint) and `supervised` is the
supervisor's handle on the process.
"""
