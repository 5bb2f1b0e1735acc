"""The OpenAI-compatible HTTP gateway: its own supervised process, a client of the
daemon's ZeroMQ socket through `hybridd.AsyncClient`.

`openai_schema` reads and checks the request bodies, `openai_output` writes the
responses, `errors` speaks OpenAI's error format, `api_keys` reads the keys, `app`
holds the routes, `exchange` is one generation route's HTTP exchange in raw ASGI,
`process` runs the HTTP servers (the API and, without it, a metrics endpoint) and
`supervised` is the supervisor's handle on the process.
"""
