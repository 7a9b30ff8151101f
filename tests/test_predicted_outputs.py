"""OpenAI Predicted Outputs on vLLM's server (lookup_decode.vllm.PredictedOutputs), without vLLM: the field's
parsing and its 400s, the counts against a brute-force longest common subsequence, and the middleware driven by a
fake ASGI app standing in for vLLM's (its state: vllm_config, engine_client with a character tokenizer).
The real server: tests/test_vllm_predicted_outputs.py."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookup_decode.engines.vllm import predicted_outputs as po
from lookup_decode.vllm import PredictedOutputs

LOOKUP = SimpleNamespace(method="custom_class", model="lookup_decode.vllm.LookupDrafter")


def lcs_reference(a, b) -> int:
    """The textbook dynamic programme."""
    row = [0] * (len(b) + 1)
    for x in a:
        prev = row[:]
        for j, y in enumerate(b):
            row[j + 1] = prev[j] + 1 if x == y else max(prev[j + 1], row[j])
    return row[-1]


# -- the field ------------------------------------------------------------------------------------------------
def test_a_string_and_text_parts_give_the_text():
    assert po.prediction_text({"type": "content", "content": "def f(): pass"}) == "def f(): pass"
    parts = [{"type": "text", "text": "def f():"}, {"type": "text", "text": " pass"}]
    assert po.prediction_text({"type": "content", "content": parts}) == "def f(): pass"
    assert po.prediction_text({"type": "content", "content": ""}) == ""


@pytest.mark.parametrize("value, words", [
    ("def f(): pass", "prediction must be"),
    ({"type": "text", "content": "x"}, "prediction must be"),
    ({"content": "x"}, "prediction must be"),
    ({"type": "content", "content": "x", "extra": 1}, "prediction must be"),
    ({"type": "content", "content": 3}, "prediction.content must be"),
    ({"type": "content", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}, "prediction.content[0]"),
    ({"type": "content", "content": [{"type": "text", "text": "a"}, "b"]}, "prediction.content[1]"),
    ({"type": "content", "content": [{"type": "text", "text": 5}]}, "only text can be predicted"),
])
def test_malformed_predictions_are_named(value, words):
    with pytest.raises(po.PredictionError, match=words.replace("[", r"\[").replace("(", r"\(")):
        po.prediction_text(value)


def test_a_prediction_over_the_limit_is_refused(monkeypatch):
    monkeypatch.setattr(po, "MAX_PREDICTION_CHARS", 10)
    assert po.prediction_text({"type": "content", "content": "x" * 10}) == "x" * 10
    with pytest.raises(po.PredictionError, match="11 characters, more than the server's limit of 10"):
        po.prediction_text({"type": "content", "content": [{"type": "text", "text": "x" * 11}]})


def test_the_text_goes_to_vllm_xargs_with_the_drafter_only():
    request = {"model": "m", "prediction": {"type": "content", "content": "abc"}, "vllm_xargs": {"other": 1}}
    assert po.take_prediction(request, True) == "abc"
    assert request == {"model": "m", "vllm_xargs": {"other": 1, "lookup_decode_prediction": "abc"}}
    request = {"model": "m", "prediction": {"type": "content", "content": "abc"}}
    assert po.take_prediction(request, False) == "abc" and request == {"model": "m"}


@pytest.mark.parametrize("extra, words", [
    ({"vllm_xargs": {"lookup_decode_prediction": "x"}}, "give the prediction once"),
    ({"vllm_xargs": "x"}, "vllm_xargs must be an object"),
    ({"echo": True}, "echo is not supported"),
])
def test_conflicting_requests_are_refused(extra, words):
    with pytest.raises(po.PredictionError, match=words):
        po.take_prediction({"prediction": {"type": "content", "content": "a"}, **extra}, True)


def test_the_drafter_is_recognised_by_its_class():
    assert po.is_lookup_drafter(LOOKUP)
    assert po.is_lookup_drafter(SimpleNamespace(method="custom_class",
                                                model="lookup_decode.engines.vllm.drafter.LookupDrafter"))
    assert not po.is_lookup_drafter(None)
    assert not po.is_lookup_drafter(SimpleNamespace(method="ngram", model=None))
    assert not po.is_lookup_drafter(SimpleNamespace(method="custom_class", model="json.JSONDecoder"))
    assert not po.is_lookup_drafter(SimpleNamespace(method="custom_class", model="no_such_module.Drafter"))


# -- the counts -----------------------------------------------------------------------------------------------
def test_lcs_worked_examples():
    assert po.lcs_length([1, 2, 3, 4], [1, 3, 5, 4]) == 3
    assert po.lcs_length([], [1]) == 0 and po.lcs_length([1], []) == 0
    assert po.lcs_length(list(range(200)), list(range(200))) == 200
    assert po.prediction_counts([5, 6, 7], [5, 7, 8]) == {"accepted_prediction_tokens": 2,
                                                          "rejected_prediction_tokens": 1}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=90), st.lists(st.integers(0, 5), max_size=90))
def test_lcs_equals_the_dynamic_programme(a, b):
    assert po.lcs_length(a, b) == lcs_reference(a, b)


# -- the middleware -------------------------------------------------------------------------------------------
class Chars:
    """A tokenizer of one token per character."""

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return [ord(c) for c in text]


def counts(prediction: str, *completions: str) -> dict:
    got = [po.prediction_counts([ord(c) for c in prediction], [ord(c) for c in text]) for text in completions]
    return {key: sum(g[key] for g in got) for key in got[0]}


def fake_vllm(answer, *, status=200, stream=False, pieces=1):
    """An ASGI app: records the request body it reads, answers `answer` (a dict, or SSE events as a list of dicts
    and "[DONE]") in `pieces` body messages."""
    seen = {}

    async def app(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen["request"], seen["headers"] = json.loads(body), dict(scope["headers"])
        if stream:
            out = b"".join(b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode()) + b"\n\n"
                           for e in answer)
            kind = b"text/event-stream; charset=utf-8"
        else:
            out, kind = json.dumps(answer).encode(), b"application/json"
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", kind), (b"content-length", str(len(out)).encode())]})
        cut = [len(out) * i // pieces for i in range(pieces + 1)]
        for i in range(pieces):
            await send({"type": "http.response.body", "body": out[cut[i]:cut[i + 1]], "more_body": i < pieces - 1})

    return app, seen


def call(app, request: dict, *, path="/v1/chat/completions", spec=LOOKUP, method="POST", tokenizer=Chars):
    """Run one request through PredictedOutputs(app); returns (status, headers dict, body bytes)."""
    state = SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=spec),
                            engine_client=SimpleNamespace(get_tokenizer=tokenizer))
    body = json.dumps(request).encode()
    scope = {"type": "http", "method": method, "path": path, "app": SimpleNamespace(state=state),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    sent, messages = [], [{"type": "http.request", "body": body[:7], "more_body": True},
                          {"type": "http.request", "body": body[7:], "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(PredictedOutputs(app)(scope, receive, send))
    start = sent[0]
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


def prediction(text: str) -> dict:
    return {"type": "content", "content": text}


PREDICTED = "def total(items):\n    return sum(items)\n"
OUTPUT = "def grand_total(items):\n    return sum(items)\n"


def chat_answer(texts: list[str]) -> dict:
    return {"id": "x", "choices": [{"index": i, "message": {"role": "assistant", "content": t}}
                                   for i, t in enumerate(texts)],
            "usage": {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}}


def test_a_chat_request_drafts_from_its_prediction_and_is_answered_with_the_counts():
    app, seen = fake_vllm(chat_answer([OUTPUT]))
    status, headers, body = call(app, {"model": "m", "messages": [], "prediction": prediction(PREDICTED)})
    assert "prediction" not in seen["request"]
    assert seen["request"]["vllm_xargs"] == {"lookup_decode_prediction": PREDICTED}
    assert int(seen["headers"][b"content-length"]) == len(json.dumps(seen["request"]).encode())
    assert status == 200 and headers[b"x-lookup-decode-prediction"] == b"drafter"
    assert int(headers[b"content-length"]) == len(body)
    details = json.loads(body)["usage"]["completion_tokens_details"]
    assert details == counts(PREDICTED, OUTPUT) and details["accepted_prediction_tokens"] > 0
    assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] == len(PREDICTED)


def test_the_counts_of_several_choices_add_up_and_keep_other_details():
    answer = chat_answer([OUTPUT, "nothing alike"])
    answer["usage"]["completion_tokens_details"] = {"reasoning_tokens": 0}
    app, _ = fake_vllm(answer, pieces=3)
    _, _, body = call(app, {"model": "m", "messages": [], "n": 2, "prediction": prediction(PREDICTED)})
    assert json.loads(body)["usage"]["completion_tokens_details"] == {
        "reasoning_tokens": 0, **counts(PREDICTED, OUTPUT, "nothing alike")}


def test_a_completions_request_with_text_parts():
    answer = {"choices": [{"index": 0, "text": OUTPUT}], "usage": {"completion_tokens": 5}}
    app, seen = fake_vllm(answer)
    parts = {"type": "content", "content": [{"type": "text", "text": PREDICTED[:10]},
                                            {"type": "text", "text": PREDICTED[10:]}]}
    _, _, body = call(app, {"model": "m", "prompt": "p", "prediction": parts}, path="/v1/completions")
    assert seen["request"]["vllm_xargs"] == {"lookup_decode_prediction": PREDICTED}
    assert json.loads(body)["usage"]["completion_tokens_details"] == counts(PREDICTED, OUTPUT)


def stream_events(output: str, chat=True) -> list:
    pieces = [output[i:i + 7] for i in range(0, len(output), 7)]
    events = [{"choices": [{"index": 0, "delta": {"content": p}} if chat else {"index": 0, "text": p}]}
              for p in pieces]
    return events + [{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9}}, "[DONE]"]


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("pieces", [1, 5, 97])
def test_a_stream_gets_the_counts_in_its_final_usage_chunk_only(chat, pieces):
    events = stream_events(OUTPUT, chat)
    app, _ = fake_vllm(events, stream=True, pieces=pieces)
    status, headers, body = call(app, {"model": "m", "prompt": "p", "stream": True,
                                       "stream_options": {"include_usage": True}, "prediction": prediction(PREDICTED)},
                                 path="/v1/chat/completions" if chat else "/v1/completions")
    assert status == 200 and headers[b"x-lookup-decode-prediction"] == b"drafter"
    got = body.decode().split("\n\n")
    assert got[-1] == "" and got[-2] == "data: [DONE]"
    assert [json.loads(e[6:]) for e in got[:-3]] == events[:-2]
    usage = json.loads(got[-3][6:])["usage"]
    assert usage == {"prompt_tokens": 3, "completion_tokens": 9, "completion_tokens_details": counts(PREDICTED, OUTPUT)}


@pytest.mark.parametrize("value", ["text", {"type": "content", "content": [{"type": "image_url"}]}])
def test_a_malformed_prediction_is_answered_400_and_never_reaches_the_engine(value):
    app, seen = fake_vllm(chat_answer(["x"]))
    status, headers, body = call(app, {"model": "m", "messages": [], "prediction": value})
    error = json.loads(body)["error"]
    assert status == 400 and error["code"] == 400 and error["param"] == "prediction"
    assert "prediction" in error["message"] and seen == {}
    assert int(headers[b"content-length"]) == len(body)


def test_a_server_without_the_drafter_says_so_and_still_counts():
    app, seen = fake_vllm(chat_answer([OUTPUT]))
    middleware_calls = [call(app, {"model": "m", "messages": [], "prediction": prediction(PREDICTED)},
                             spec=SimpleNamespace(method="ngram", model=None)) for _ in range(2)]
    for status, headers, body in middleware_calls:
        assert headers[b"x-lookup-decode-prediction"] == b"none"
        assert json.loads(body)["usage"]["completion_tokens_details"] == counts(PREDICTED, OUTPUT)
    assert "vllm_xargs" not in seen["request"] and "prediction" not in seen["request"]


def test_the_warning_without_the_drafter_is_logged_once(caplog):
    app, _ = fake_vllm(chat_answer([OUTPUT]))
    middleware = PredictedOutputs(app)
    state = SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=None),
                            engine_client=SimpleNamespace(get_tokenizer=Chars))
    body = json.dumps({"messages": [], "prediction": prediction("a")}).encode()

    async def twice():
        for _ in range(2):
            messages = [{"type": "http.request", "body": body}]

            async def receive():
                return messages.pop(0)

            async def send(message):
                pass
            await middleware({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [],
                              "app": SimpleNamespace(state=state)}, receive, send)

    with caplog.at_level(logging.WARNING, logger="lookup_decode.vllm"):
        asyncio.run(twice())
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "not lookup_decode.vllm.LookupDrafter" in caplog.records[0].getMessage()


@pytest.mark.parametrize("request_, path, method", [
    ({"model": "m", "messages": []}, "/v1/chat/completions", "POST"),            # no prediction
    ({"model": "m", "prediction": prediction("a")}, "/v1/embeddings", "POST"),   # not a completion
    ({"model": "m", "prediction": prediction("a")}, "/v1/chat/completions", "GET"),
])
def test_other_requests_pass_untouched(request_, path, method):
    app, seen = fake_vllm(chat_answer([OUTPUT]))
    status, headers, body = call(app, request_, path=path, method=method)
    assert seen["request"] == request_ and b"x-lookup-decode-prediction" not in headers
    assert json.loads(body) == chat_answer([OUTPUT])


def test_a_null_prediction_is_no_prediction():
    app, seen = fake_vllm(chat_answer([OUTPUT]))
    _, headers, body = call(app, {"model": "m", "prediction": None})
    assert seen["request"] == {"model": "m"} and b"x-lookup-decode-prediction" not in headers


def test_an_engine_error_passes_through_with_the_header():
    app, _ = fake_vllm({"error": {"message": "too long", "code": 400}}, status=400)
    status, headers, body = call(app, {"model": "m", "messages": [], "prediction": prediction("a")})
    assert status == 400 and json.loads(body)["error"]["message"] == "too long"
    assert headers[b"x-lookup-decode-prediction"] == b"drafter"


def test_an_answer_whose_counting_fails_goes_out_without_the_counts(caplog):
    class Broken:
        def encode(self, text, add_special_tokens=True):
            raise RuntimeError("no tokenizer")

    for stream in (False, True):
        answer = stream_events(OUTPUT) if stream else chat_answer([OUTPUT])
        app, _ = fake_vllm(answer, stream=stream)
        with caplog.at_level(logging.ERROR, logger="lookup_decode.vllm"):
            status, headers, body = call(app, {"model": "m", "messages": [], "stream": stream,
                                               "prediction": prediction(PREDICTED)}, tokenizer=Broken)
        assert status == 200
        usage = json.loads(body.decode().split("\n\n")[-3][6:] if stream else body)["usage"]
        assert "completion_tokens_details" not in usage
    assert sum("counting the prediction's tokens failed" in r.getMessage() for r in caplog.records) == 2
