"""`POST /tokenize` and `POST /detokenize` in vLLM's shapes, with the served model's
tokenizer (its `tokenizer.json`, read with the `tokenizers` library: the gateway loads
no model code).

`/tokenize` takes `{"model", "prompt", "add_special_tokens"}` and answers
`{"count", "max_model_len", "tokens"}`; `/detokenize` takes `{"model", "tokens"}` and
answers `{"prompt"}`. The tokenizer is loaded at the first call, off the event loop.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from hybridd.errors import HybriddError
from hybridd.gateway.errors import GatewayError, bad_request
from hybridd.protocol.limits import MAX_PROMPT_CHARS, MAX_PROMPT_TOKEN_IDS

if TYPE_CHECKING:
    from hybridd.gateway.app import Gateway

MAX_BODY_BYTES = 8 * 1024 * 1024


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


class Tokenize:
    """The two routes over the model directory's tokenizer."""

    def __init__(self, model_path: str, gateway: Gateway) -> None:
        self.path = Path(model_path) / "tokenizer.json"
        self.gateway = gateway
        self._tokenizer: Any = None
        self._max_model_len: int | None = None

    async def _load(self) -> Any:
        if self._tokenizer is None:
            if not self.path.is_file():
                raise GatewayError(501, f"/tokenize needs the model's tokenizer.json; {self.path} does not exist",
                                   type="not_implemented_error", code="no_tokenizer")
            from tokenizers import Tokenizer

            self._tokenizer = await asyncio.to_thread(Tokenizer.from_file, str(self.path))
        return self._tokenizer

    async def _parse(self, request: Request, kind: type) -> Any:
        self.gateway.authorize(request.headers.get("authorization", ""))
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise GatewayError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large")
        try:
            body = msgspec.json.decode(raw, type=kind)
        except msgspec.ValidationError as error:
            raise bad_request(f"body: {error}") from None
        except msgspec.DecodeError as error:
            raise GatewayError(400, f"the request body is not valid JSON: {error}", code="invalid_json") from None
        if body.model is not None:
            self.gateway.check_model(body.model)
        return body

    async def max_model_len(self) -> int | None:
        if self._max_model_len is None:
            try:
                status = await self.gateway.client.status(timeout=5.0)
            except HybriddError:
                return None
            self._max_model_len = status.get("max_model_len") or None
        return self._max_model_len

    async def tokenize(self, request: Request) -> Response:
        body: TokenizeRequest = await self._parse(request, TokenizeRequest)
        if len(body.prompt) > MAX_PROMPT_CHARS:
            raise bad_request(f"prompt: at most {MAX_PROMPT_CHARS} characters", "prompt")
        tokenizer = await self._load()
        tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens).ids
        return JSONResponse({"count": len(tokens), "max_model_len": await self.max_model_len(), "tokens": tokens})

    async def detokenize(self, request: Request) -> Response:
        body: DetokenizeRequest = await self._parse(request, DetokenizeRequest)
        if len(body.tokens) > MAX_PROMPT_TOKEN_IDS:
            raise bad_request(f"tokens: at most {MAX_PROMPT_TOKEN_IDS} token ids", "tokens")
        tokenizer = await self._load()
        vocab = tokenizer.get_vocab_size()
        if bad := [t for t in body.tokens if not 0 <= t < vocab]:
            raise bad_request(f"tokens: {bad[0]} is not a token id of this model (0..{vocab - 1})", "tokens")
        return JSONResponse({"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)})
