"""OpenAI's Predicted Outputs on vLLM's real OpenAI server (`--middleware lookup_decode.vllm.PredictedOutputs`),
through the `openai` client's `prediction=`: streamed and not, the same text as without the prediction, the
drafter told (header `x-lookup-decode-prediction: drafter`, vLLM's per-request metrics), accepted/rejected
prediction tokens equal to their definition (the longest common subsequence of the tokenized prediction and
completion, computed here by the textbook dynamic programme), malformed predictions answered 400. A server
without the drafter says so (`none`) and still counts. The unit tests: tests/test_predicted_outputs.py."""

from __future__ import annotations

import importlib.util
import json

import pytest
import vllm_support as vs
from test_predicted_outputs import lcs_reference
from vllm_support import VLLM_MARKS

pytestmark = VLLM_MARKS + [pytest.mark.skipif(importlib.util.find_spec("openai") is None, reason="needs openai")]

MIDDLEWARE = ["--middleware", "lookup_decode.vllm.PredictedOutputs"]
MAX_TOKENS = 128
LIMIT = 20_000                  # the server's LOOKUP_DECODE_MAX_PREDICTION_CHARS here
BAD = [{"type": "content", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]},
       {"type": "content"}, {"type": "content", "content": "x" * (LIMIT + 1)}]


def _server_env() -> dict:
    env = vs.child_env(LOOKUP_DECODE_MAX_PREDICTION_CHARS=LIMIT)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)                        # the server's own engine process
    return env


def _ask(url: str, prediction=None, *, stream=False, parts=False) -> dict:
    """One greedy chat completion of the SHOP edit: text, usage's prediction counts, the header, vLLM's metrics."""
    from openai import OpenAI
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    kw = dict(model=vs.model_folder(), messages=[{"role": "user", "content": vs.edit_prompt()}], temperature=0,
              max_tokens=MAX_TOKENS)
    if prediction is not None:
        content = [{"type": "text", "text": prediction[:40]}, {"type": "text", "text": prediction[40:]}] if parts \
            else prediction
        kw["prediction"] = {"type": "content", "content": content}
    if stream:
        raw = client.chat.completions.with_raw_response.create(stream=True, stream_options={"include_usage": True},
                                                               **kw)
        chunks = list(raw.parse())
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage, extra = chunks[-1].usage, chunks[-1].model_extra or {}
        assert [c for c in chunks if c.usage is not None] == [chunks[-1]]
    else:
        raw = client.chat.completions.with_raw_response.create(**kw)
        resp = raw.parse()
        text, usage, extra = resp.choices[0].message.content, resp.usage, resp.model_extra or {}
    details = usage.completion_tokens_details
    return {"text": text, "header": raw.headers.get("x-lookup-decode-prediction"),
            "accepted": details and details.accepted_prediction_tokens,
            "rejected": details and details.rejected_prediction_tokens,
            "spec": (extra.get("metrics") or {}).get("speculative_decoding")}


def _refused(url: str, value) -> tuple[int, str] | None:
    """A request with the prediction `value`: (status, message) of the openai client's BadRequestError, or None."""
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    try:
        client.chat.completions.create(model=vs.model_folder(), messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, prediction=value)
    except openai.BadRequestError as e:
        return e.status_code, str(e)
    return None


def _expected(tok, prediction: str, completion: str) -> tuple[int, int]:
    """OpenAI's counts by their stated definition (docs/fast-apply.md)."""
    p = tok(prediction, add_special_tokens=False)["input_ids"]
    accepted = lcs_reference(p, tok(completion, add_special_tokens=False)["input_ids"])
    return accepted, len(p) - accepted


def test_the_prediction_field_on_a_server_with_the_drafter(tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(vs.model_folder())
    args = ["--speculative-config", json.dumps(vs.LOOKUP_SPEC), "--per-request-spec-decode-metrics", "summary"]
    with vs.serve(tmp_path / "server.log", args + MIDDLEWARE, env=_server_env()) as url:
        plain = _ask(url)
        exact = _ask(url, plain["text"])                            # the prediction is the output itself
        file_streamed = _ask(url, vs.SHOP, stream=True, parts=True)   # fast apply: the original file
        file_plain = _ask(url, vs.SHOP)
        refused = [_refused(url, value) for value in BAD]
        after = _ask(url, plain["text"], stream=True)               # still serving

    assert plain["header"] is None and plain["accepted"] is None
    for run in (exact, file_streamed, file_plain, after):
        assert run["text"] == plain["text"]
        assert run["header"] == "drafter"
    assert (exact["accepted"], exact["rejected"]) == _expected(tok, plain["text"], plain["text"])
    assert exact["accepted"] > 0 and exact["rejected"] == 0
    for run in (file_streamed, file_plain):
        assert (run["accepted"], run["rejected"]) == _expected(tok, vs.SHOP, plain["text"])
        assert run["accepted"] > 0
    # the drafter drafted from it: more accepted draft tokens with the output as prediction than without one
    assert exact["spec"]["num_accepted_draft_tokens"] > plain["spec"]["num_accepted_draft_tokens"], \
        (exact["spec"], plain["spec"])
    assert all(r is not None and r[0] == 400 and "prediction" in r[1] for r in refused), refused
    assert f"limit of {LIMIT}" in refused[2][1], refused[2]


def test_a_server_without_the_drafter_says_so_and_counts(tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(vs.model_folder())
    log = tmp_path / "server.log"
    with vs.serve(log, MIDDLEWARE, env=_server_env()) as url:
        plain = _ask(url)
        streamed = _ask(url, vs.SHOP, stream=True)
    assert streamed["text"] == plain["text"] and streamed["header"] == "none"
    assert (streamed["accepted"], streamed["rejected"]) == _expected(tok, vs.SHOP, plain["text"])
    assert "not lookup_decode.vllm.LookupDrafter" in log.read_text(errors="replace")
