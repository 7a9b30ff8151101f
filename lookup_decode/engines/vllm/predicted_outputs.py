"""OpenAI's Predicted Outputs on vLLM's OpenAI server: `python -m vllm.entrypoints.openai.api_server ...
--middleware lookup_decode.vllm.PredictedOutputs` (vLLM loads `--middleware` classes by dotted path).

On POST /v1/chat/completions and /v1/completions, a request's `prediction` field
({"type": "content", "content": str | [{"type": "text", "text": str}, ...]}) is checked (HTTP 400 naming the
problem: not that shape, a part that is not text, more than MAX_PREDICTION_CHARS characters, or a
`lookup_decode_prediction` in vllm_xargs as well), removed, and its text handed to the drafter as the request's
`lookup_decode_prediction` (vllm_xargs; request_args.py). Streamed or not.

Answers: `usage.completion_tokens_details.accepted_prediction_tokens` / `rejected_prediction_tokens`, in the
response (not streamed) or in the stream's final usage chunk (`stream_options={"include_usage": true}`). They
are computed here, in the server process: the prediction text and each choice's completion text are tokenized
with the served model's tokenizer (no special tokens); accepted = the length of the longest common subsequence
of the two token lists (the tokens of the prediction that appear, in order, in the completion), rejected = the
prediction's tokens - accepted; summed over the choices. Every answer to a request with a prediction carries
the header `x-lookup-decode-prediction`: `drafter` (the server's speculative method is lookup_decode's
drafter: the prediction drafts) or `none` (it is not: the prediction is only counted, and the server logs so).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os

from lookup_decode.engines.vllm.request_args import PREDICTION, shown
from lookup_decode.engines.vllm.settings import show_logs

log = logging.getLogger("lookup_decode.vllm")
PATHS = ("/v1/chat/completions", "/v1/completions")
MAX_PREDICTION_CHARS = int(os.environ.get("LOOKUP_DECODE_MAX_PREDICTION_CHARS", 1_000_000))
HEADER = b"x-lookup-decode-prediction"
SHAPE = '{"type": "content", "content": a string or a list of {"type": "text", "text": a string}}'


class PredictionError(ValueError):
    """A malformed prediction: the server answers 400 with this message."""


def prediction_text(value) -> str:
    """The text of an OpenAI `prediction` value; PredictionError naming what is wrong.
    Example: prediction_text({"type": "content", "content": [{"type": "text", "text": "a"}, {"type": "text",
    "text": "b"}]}) -> "ab"."""
    if not isinstance(value, dict) or value.get("type") != "content" or set(value) != {"type", "content"}:
        raise PredictionError(f"prediction must be {SHAPE}, got {shown(value)}")
    content = value["content"]
    if isinstance(content, list):
        bad = [i for i, part in enumerate(content) if not isinstance(part, dict) or part.get("type") != "text"
               or not isinstance(part.get("text"), str) or set(part) != {"type", "text"}]
        if bad:
            raise PredictionError(f"prediction.content[{bad[0]}] must be a text part {{\"type\": \"text\", "
                                  f"\"text\": a string}} (only text can be predicted), got {shown(content[bad[0]])}")
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise PredictionError(f"prediction.content must be a string or a list of text parts, got {shown(content)}")
    if len(content) > MAX_PREDICTION_CHARS:
        raise PredictionError(f"prediction has {len(content)} characters, more than the server's limit of "
                              f"{MAX_PREDICTION_CHARS} (LOOKUP_DECODE_MAX_PREDICTION_CHARS)")
    return content


def lcs_length(a, b) -> int:
    """Length of the longest common subsequence of token lists a and b (bit-parallel: one pass over b with a's
    positions as the bits of a Python int; Hyyrö 2004). Example: lcs_length([1, 2, 3, 4], [1, 3, 5, 4]) -> 3."""
    n = len(a)
    if not n or not b:
        return 0
    wanted = set(b)
    positions: dict = {}
    for i, t in enumerate(a):
        if t in wanted:
            positions.setdefault(t, []).append(i)
    masks = {}
    for t, where in positions.items():
        bits = bytearray(n // 8 + 1)
        for i in where:
            bits[i >> 3] |= 1 << (i & 7)
        masks[t] = int.from_bytes(bits, "little")
    full = (1 << n) - 1
    v = full
    for t in b:
        u = v & masks.get(t, 0)
        if u:
            v = ((v + u) | (v - u)) & full
    return n - v.bit_count()


def prediction_counts(prediction_ids, completion_ids) -> dict:
    """{"accepted_prediction_tokens": the LCS length, "rejected_prediction_tokens": the rest of the prediction}."""
    accepted = lcs_length(list(prediction_ids), list(completion_ids))
    return {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": len(prediction_ids) - accepted}


def take_prediction(request: dict, drafter: bool) -> str:
    """Remove `prediction` from a request body (a dict) and return its text; with the drafter, put the text into
    vllm_xargs as lookup_decode_prediction. PredictionError for a malformed one."""
    text = prediction_text(request.pop("prediction"))
    xargs = request.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        raise PredictionError(f"vllm_xargs must be an object, got {shown(xargs)}")
    if xargs and PREDICTION in xargs:
        raise PredictionError(f"give the prediction once: either prediction or vllm_xargs.{PREDICTION}")
    if request.get("echo"):
        raise PredictionError("prediction with echo is not supported (the counts compare the prediction with the "
                              "completion alone)")
    if drafter and text:
        request["vllm_xargs"] = {**(xargs or {}), PREDICTION: text}
    return text


def is_lookup_drafter(speculative_config) -> bool:
    """Whether vLLM's speculative config runs lookup_decode's LookupDrafter (or a subclass)."""
    if speculative_config is None or getattr(speculative_config, "method", None) != "custom_class":
        return False
    path = str(getattr(speculative_config, "model", None) or "")
    from lookup_decode.engines.vllm.drafter import LookupDrafter
    try:
        module, name = path.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), name)
        return isinstance(cls, type) and issubclass(cls, LookupDrafter)
    except Exception:                                          # noqa: BLE001 - any failure: not ours
        return False


class PredictedOutputs:
    """The ASGI middleware (module docstring). It reads vLLM's app state (`scope["app"].state`: vllm_config,
    engine_client) when the first prediction arrives."""

    def __init__(self, app):
        self.app = app
        self._drafter: bool | None = None
        self._tokenizer = None
        self._warned = False
        show_logs()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in PATHS:
            return await self.app(scope, receive, send)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":              # the client left before sending its body
                return await self.app(scope, _replay(bytes(body), receive), send)
            body += message.get("body", b"")
            more = message.get("more_body", False)
        try:
            request = json.loads(body)
        except ValueError:
            request = None
        if not isinstance(request, dict) or "prediction" not in request:
            return await self.app(scope, _replay(bytes(body), receive), send)
        if request["prediction"] is None:                      # null: no prediction
            del request["prediction"]
            return await self.app(scope, _replay(json.dumps(request).encode(), receive), send)
        state = scope["app"].state
        if self._drafter is None:
            self._drafter = is_lookup_drafter(getattr(state.vllm_config, "speculative_config", None))
        try:
            text = take_prediction(request, self._drafter)
        except PredictionError as e:
            return await _bad_request(send, str(e))
        if not self._drafter and not self._warned:
            self._warned = True
            log.warning("lookup_decode: a request brought a prediction, but this server's speculative method "
                        "is not lookup_decode.vllm.LookupDrafter: predictions are counted, not drafted from "
                        "(answers carry x-lookup-decode-prediction: none)")
        if self._tokenizer is None:
            try:
                self._tokenizer = state.engine_client.get_tokenizer()
            except Exception:                                  # noqa: BLE001 - skip_tokenizer_init: no counts
                log.exception("lookup_decode: the served model's tokenizer is not available: no prediction counts")
        body = json.dumps(request).encode()
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        scope = {**scope, "headers": headers + [(b"content-length", str(len(body)).encode())]}
        counter = _Counter(self._tokenizer, text, b"drafter" if self._drafter else b"none", send)
        await self.app(scope, _replay(body, receive), counter.send)


class _Counter:
    """The response side: the header, and the counts written into usage (the whole JSON, or the stream's events)."""

    def __init__(self, tokenizer, prediction: str, used: bytes, send):
        self.tokenizer, self.prediction, self.used, self.send_on = tokenizer, prediction, used, send
        self.start, self.stream, self.body, self.texts = None, False, bytearray(), {}

    def counts(self, completions) -> dict:
        encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)   # noqa: E731
        predicted = encode(self.prediction)
        total = {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
        for text in completions:
            for key, n in prediction_counts(predicted, encode(text)).items():
                total[key] += n
        return total

    async def with_counts(self, usage: dict, completions) -> None:
        """usage with the counts in completion_tokens_details; unchanged if counting fails (logged: an answer is
        never lost for its counts)."""
        try:
            counts = await asyncio.to_thread(self.counts, completions)
        except Exception:                                      # noqa: BLE001
            log.exception("lookup_decode: counting the prediction's tokens failed; the answer goes without them")
            return
        usage["completion_tokens_details"] = {**(usage.get("completion_tokens_details") or {}), **counts}

    async def send(self, message):
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER] + [(HEADER, self.used)]
            self.start = {**message, "headers": headers}
            kind = dict((k.lower(), v) for k, v in headers).get(b"content-type", b"")
            self.stream = message["status"] != 200 or kind.startswith(b"text/event-stream")
            if self.stream:
                await self.send_on(self.start)
            return
        if message["type"] != "http.response.body" or self.start["status"] != 200:   # an error answer: as it is
            return await self.send_on(message)
        self.body += message.get("body", b"")
        more = message.get("more_body", False)
        if self.stream:
            events, _, rest = bytes(self.body).rpartition(b"\n\n")
            self.body = bytearray(rest)
            out = b"".join([await self.event(e) + b"\n\n" for e in events.split(b"\n\n")] if events else [])
            if out or not more:
                await self.send_on({**message, "body": out + (b"" if more else bytes(self.body))})
            return
        if more:
            return
        body = bytes(self.body)
        try:
            answer = json.loads(body)
            if isinstance(answer.get("usage"), dict):
                await self.with_counts(answer["usage"], [_text(c, False) for c in answer.get("choices") or []])
                body = json.dumps(answer).encode()
        except (ValueError, AttributeError):
            pass
        headers = [(k, v) for k, v in self.start["headers"] if k.lower() != b"content-length"]
        await self.send_on({**self.start, "headers": headers + [(b"content-length", str(len(body)).encode())]})
        await self.send_on({**message, "body": body})

    async def event(self, event: bytes) -> bytes:
        """One server-sent event: its choices' text kept, the counts put in the final usage chunk."""
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            return event
        try:
            chunk = json.loads(event[6:])
        except ValueError:
            return event
        choices = chunk.get("choices") or []
        for c in choices:
            self.texts[c.get("index", 0)] = self.texts.get(c.get("index", 0), "") + _text(c, True)
        if choices or not isinstance(chunk.get("usage"), dict):
            return event
        await self.with_counts(chunk["usage"], list(self.texts.values()))
        return b"data: " + json.dumps(chunk).encode()


def _text(choice: dict, delta: bool) -> str:
    """A choice's text: chat (message or delta content) or completions (text)."""
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta" if delta else "message") or {}).get("content") or ""


def _replay(body: bytes, receive):
    """A receive that gives the (rewritten) body once, then the client's own messages (a disconnect)."""
    sent = False

    async def again():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}
    return again


async def _bad_request(send, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": "prediction",
                                 "code": 400}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})

