"""Per-request control of the vLLM drafter, on the simulated runner (tests/sim_runner.py with ids=True shows
the drafter what vLLM's runner does: request ids per row, each request's prompt length and sampling params):
rows followed by id, `lookup_decode_k`, `lookup_decode_prediction`, `lookup_decode_scope`, per-request counters,
and bad values. The real engine: tests/test_vllm_requests.py."""

import logging

import numpy as np
import pytest

from lookup_decode.core.draft import kept_prefix
from lookup_decode.core.index import SuffixIndex
from lookup_decode.engines.vllm import drafter as lv
from lookup_decode.engines.vllm.request_args import RequestArgs, parse
from tests.sim_runner import SimRequest, SimRunner
from tests.test_vllm import EOS, FULL, _compare, _drafter, _requests


def _copy_free(seed: int, n: int) -> list[SimRequest]:
    """Requests whose continuations copy nothing of their prompts: only a prediction or a memory drafts well."""
    return _requests(seed=seed, n=n, copy=False)


# -- rows followed by the runner's request ids --------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 8])
def test_runner_ids_give_the_transformers_path_drafts_while_rows_move(k):
    requests = _requests(seed=20 + k, n=30, chunk=32)
    drafter = _drafter(k, lv.Settings(adaptive=False, memory=False))
    SimRunner(drafter, max_num_reqs=8, seed=k, p_unscheduled=0.05, p_swap=0.3, arrivals_per_step=2, k=k,
              ids=True).run(requests)
    compared, accepted = _compare(requests, lambda: SuffixIndex(eos_token_ids=EOS), k, None)
    assert compared > 150 and accepted > 80                  # guard: drafts were produced and accepted
    assert drafter.stats.identity == "runner"
    assert drafter.stats.built == len(requests) and drafter.stats.rebuilt == 0
    assert drafter.live_requests == 0                       # finished requests left with their ids


def test_runner_ids_rebuild_nothing_after_skips_and_long_preemptions():
    """Preempted for longer than idle_steps and skipped as a whole batch near max_model_len: by content such
    requests are rebuilt from their rows; by id they are waited for and continued."""
    rng = np.random.default_rng(9)
    requests = [SimRequest(rng.integers(3, 12, size=int(n)).astype(np.int32),
                           np.tile(np.arange(3, 9), 40)[:int(m)].astype(np.int32))
                for n, m in [(40, 150), (30, 100), (60, 150), (20, 80), (50, 120), (25, 140)]]
    drafter = _drafter(4, lv.Settings(adaptive=False, idle_steps=4))
    runner = SimRunner(drafter, max_num_reqs=4, max_model_len=200, k=4, seed=3, p_preempt=0.03, preempt_steps=12,
                       ids=True)
    runner.run(requests)
    assert runner.skipped > 0 and runner.preempted > 0 and drafter.stats.continued > 0   # guard: both happened
    assert drafter.stats.built == len(requests) and drafter.stats.rebuilt == 0 and drafter.stats.resumed == 0
    assert all(r.out == r.truth[: len(r.out)].tolist() for r in requests)   # (max_model_len cuts some outputs)
    assert sum(len(d) for r in requests for d in r.drafts[-5:]) > 0          # drafting went on after them
    assert drafter.live_requests == 0 and drafter.index_bytes == 0


def test_without_a_runner_rows_are_followed_by_content():
    drafter = _drafter(4, FULL)
    SimRunner(drafter, max_num_reqs=4).run(_requests(seed=1, n=4))
    assert drafter.stats.identity == "content" and drafter.stats.accepted > 0
    assert drafter.stats.request("req-0") is None


# -- lookup_decode_k ----------------------------------------------------------------------------------------------

def test_k_zero_gets_no_drafts_while_the_others_in_its_batch_keep_theirs():
    requests = _requests(seed=4, n=8)
    for r in requests[::2]:
        r.extra_args = {"lookup_decode_k": 0}
    for r in requests[1::4]:
        r.extra_args = {"lookup_decode_k": "2"}             # the server's vllm_xargs may carry numbers as text
    drafter = _drafter(8, FULL)
    SimRunner(drafter, max_num_reqs=8, ids=True).run(requests)
    assert [r.out for r in requests] == [r.truth.tolist() for r in requests]
    for r in requests[::2]:
        assert all(d == [] for d in r.drafts) and drafter.stats.request(r.id).drafted == 0
    for r in requests[1::4]:
        assert max(map(len, r.drafts)) == 2
    others = [drafter.stats.request(r.id) for r in requests[1::2]]
    assert all(s.drafted > 0 and s.accepted > 0 for s in others)
    assert sum(s.accepted for s in others) == drafter.stats.accepted    # per-request counters add up


def test_k_above_the_engine_k_is_the_engine_k():
    requests = _requests(seed=5, n=2)
    requests[0].extra_args = {"lookup_decode_k": 100}
    drafter = _drafter(4, FULL)
    SimRunner(drafter, max_num_reqs=2, k=4, ids=True).run(requests)
    assert max(map(len, requests[0].drafts)) == 4


# -- lookup_decode_prediction -------------------------------------------------------------------------------------

def test_a_prediction_drafts_for_its_own_request_alone_and_is_freed_with_it():
    with_it, without = _copy_free(seed=6, n=2)
    with_it.extra_args = {"lookup_decode_prediction": with_it.truth.tolist()}
    without.truth = with_it.truth.copy()                    # the same output, no prediction
    drafter = _drafter(8, lv.Settings(adaptive=False, memory=False))
    SimRunner(drafter, max_num_reqs=2, ids=True).run([with_it, without])
    mine, theirs = drafter.stats.request(with_it.id), drafter.stats.request(without.id)
    assert mine.sources["prediction"] > 0.8 * len(with_it.truth)
    assert theirs.sources["prediction"] == 0
    assert len(with_it.emitted) * 3 < len(without.emitted)   # far fewer steps for the same tokens
    assert with_it.out == with_it.truth.tolist()
    assert drafter.records == {}                            # freed when its request ended


def test_a_text_prediction_is_tokenized_with_the_engine_tokenizer():
    class Tokenizer:                                        # one id per character
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [3 + ord(c) % 9 for c in text]}

    req = _copy_free(seed=7, n=1)[0]
    text = "".join(chr(int(t) - 3 + 9 * 7) for t in req.truth)     # decodes to req.truth under Tokenizer
    assert Tokenizer()(text)["input_ids"] == req.truth.tolist()
    req.extra_args = {"lookup_decode_prediction": text}
    drafter = _drafter(8, lv.Settings(adaptive=False, memory=False), tokenizer=Tokenizer())
    SimRunner(drafter, max_num_reqs=1, ids=True).run([req])
    assert drafter.stats.request(req.id).sources["prediction"] > 0.8 * len(req.truth)


# -- lookup_decode_scope ------------------------------------------------------------------------------------------

def test_a_scope_never_drafts_from_another_scope_memory():
    """A's output is remembered in scope a: the same request in scope b (and in the default scope) gets no draft
    from it; in scope a again it does."""
    first = _copy_free(seed=8, n=1)[0]

    def again(scope):
        r = SimRequest(first.prompt.copy(), first.truth.copy())
        r.extra_args = None if scope is None else {"lookup_decode_scope": scope}
        return r

    first.extra_args = {"lookup_decode_scope": "a"}
    other, default, same = again("b"), again(None), again("a")
    drafter = _drafter(8, lv.Settings(adaptive=False))
    SimRunner(drafter, max_num_reqs=1, ids=True).run([first, other, default, same])
    assert [drafter.stats.request(r.id).sources["memory"] for r in (other, default)] == [0, 0]
    assert drafter.stats.request(same.id).sources["memory"] > 0.8 * len(first.truth)
    assert set(drafter.scopes) == {"a", "b"} and drafter.memory.n_tokens > 0   # the default scope has its own
    assert [r.out for r in (first, other, default, same)] == [first.truth.tolist()] * 4


def test_past_max_scopes_the_least_recently_used_idle_scope_goes():
    requests = _copy_free(seed=9, n=4)
    for j, r in enumerate(requests):
        r.extra_args = {"lookup_decode_scope": f"tenant-{j}"}
    drafter = _drafter(4, lv.Settings(adaptive=False, max_scopes=2))
    SimRunner(drafter, max_num_reqs=1, ids=True).run(requests)
    assert list(drafter.scopes) == ["tenant-2", "tenant-3"]


# -- bad values ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, private", [({"lookup_decode_k": "x"}, False), ({"lookup_decode_k": -1}, False),
                                            ({"lookup_decode_scope": 5}, True),
                                            ({"lookup_decode_prediction": [-3]}, False),
                                            ({"lookup_decode_kk": 1}, False)])
def test_a_bad_value_is_logged_and_ignored_and_the_engine_serves(extra, private, caplog):
    requests = _requests(seed=10, n=3)
    requests[0].extra_args = extra
    drafter = _drafter(8, FULL)
    with caplog.at_level(logging.WARNING, logger="lookup_decode.vllm"):
        SimRunner(drafter, max_num_reqs=3, ids=True).run(requests)
    assert [r.out for r in requests] == [r.truth.tolist() for r in requests]
    assert drafter.stats.ignored == 1 and drafter.stats.errors == 0
    assert any(requests[0].id in r.message and "lookup_decode_" in r.message for r in caplog.records)
    assert drafter.stats.request(requests[0].id).accepted > 0      # it still drafts from itself


def test_an_unreadable_scope_drafts_from_no_memory_and_stores_nothing():
    first, second = _copy_free(seed=11, n=2)
    second.prompt, second.truth = first.prompt.copy(), first.truth.copy()
    first.extra_args = second.extra_args = {"lookup_decode_scope": ""}
    drafter = _drafter(8, lv.Settings(adaptive=False))
    SimRunner(drafter, max_num_reqs=1, ids=True).run([first, second])
    assert drafter.stats.sources["memory"] == 0 and drafter.memory.n_tokens == 0 and not drafter.scopes


# -- the one reading of the keys ----------------------------------------------------------------------------------

def test_parse_reads_the_server_value_kinds():
    assert parse(None) == parse({}) == RequestArgs()
    assert parse({"lookup_decode_k": "3", "other_plugin": {"x": 1}}) == RequestArgs(k=3)
    assert parse({"lookup_decode_k": 2.0}).k == 2
    assert parse({"lookup_decode_prediction": [5, 6.0]}).prediction == (5, 6)
    assert parse({"lookup_decode_prediction": "def f():"}).prediction == "def f():"
    assert parse({"lookup_decode_prediction": ""}).prediction is None
    assert parse({"lookup_decode_scope": "tenant-1"}).scope == "tenant-1"


@pytest.mark.parametrize("extra, key", [({"lookup_decode_k": True}, "lookup_decode_k"),
                                        ({"lookup_decode_k": 1.5}, "lookup_decode_k"),
                                        ({"lookup_decode_prediction": 7}, "lookup_decode_prediction"),
                                        ({"lookup_decode_prediction": ["a"]}, "lookup_decode_prediction"),
                                        ({"lookup_decode_scope": ""}, "lookup_decode_scope"),
                                        ({"lookup_decode_scope": "x" * 300}, "lookup_decode_scope"),
                                        ({"lookup_decode_K": 1}, "lookup_decode_K")])
def test_parse_names_the_bad_key(extra, key):
    with pytest.raises(ValueError, match=key):
        parse(extra)


@pytest.mark.parametrize("version, runner, logged", [("0.32.0", True, False), ("0.33.1", True, False),
                                                     ("0.40.0", True, True), ("0.32.0", False, True)])
def test_the_path_is_logged_once_where_the_version_is_unknown_or_no_runner_is_found(version, runner, logged,
                                                                                    monkeypatch, caplog):
    monkeypatch.setattr(lv, "_vllm_version", lambda: version)
    drafter = _drafter(4, FULL)
    with caplog.at_level(logging.INFO, logger="lookup_decode.vllm"):
        if runner:
            SimRunner(drafter, max_num_reqs=2, ids=True).run(_requests(seed=12, n=2))
        else:
            drafter.load_model(None)                        # called by something that is not a runner
            SimRunner(drafter, max_num_reqs=2).run(_requests(seed=12, n=2))
    lines = [r.message for r in caplog.records if "rows are followed" in r.message]
    assert len(lines) == (1 if logged else 0)
    assert drafter.stats.identity == ("runner" if runner else "content")
    if logged:
        assert version in lines[0] and ("request ids" if runner else "by content") in lines[0]


def test_a_request_counts_what_it_was_sent_and_kept():
    """Adaptive: rows are sent a prefix of their proposals; a request's counters count that prefix alone (vLLM's
    per-request num_draft_tokens and num_accepted_draft_tokens)."""
    requests = _requests(seed=13, n=8)
    drafter = _drafter(8)
    runner = SimRunner(drafter, max_num_reqs=4, seed=3, step_seconds=lambda n: 0.05 + 0.01 * n, ids=True)
    drafter.clock = runner.clock
    runner.run(requests)
    counters = [drafter.stats.request(r.id) for r in requests]
    for r, c in zip(requests, counters):
        assert c.drafted == sum(map(len, r.drafts))
        at = np.cumsum([1] + r.emitted)                     # where each step's tokens start in the output
        kept = [kept_prefix(np.asarray(d, np.int32), r.truth[a: a + e]) for d, a, e in zip(r.drafts, at, r.emitted)]
        assert c.accepted == sum(kept)
    assert sum(c.accepted for c in counters) > 0


def test_a_tokenizer_that_cannot_load_leaves_text_predictions_unread_not_the_engine(tmp_path, monkeypatch, caplog):
    from tests.test_vllm import _vllm_config
    monkeypatch.delenv("LOOKUP_DECODE_CONFIG", raising=False)
    config = _vllm_config(k=8, vocab=20)
    config.model_config.tokenizer = str(tmp_path / "no-such-tokenizer")
    with caplog.at_level(logging.WARNING, logger="lookup_decode.vllm"):
        drafter = lv.LookupDrafter(config)
        req = _copy_free(seed=14, n=1)[0]
        req.extra_args = {"lookup_decode_prediction": "some text"}
        SimRunner(drafter, max_num_reqs=1, ids=True).run([req])
    assert any("tokenizer could not be loaded" in r.message for r in caplog.records)
    assert any(req.id in r.message and "lookup_decode_prediction" in r.message for r in caplog.records)
    assert req.out == req.truth.tolist() and drafter.stats.ignored == 1 and drafter.stats.errors == 0


def test_no_draft_runs_past_max_tokens():
    """vLLM verifies, then drops from the output, the drafts of a last step that run past max_tokens: by id the
    drafter knows where each request ends and sends none of them (by content it cannot)."""
    def past_the_end(ids: bool) -> int:
        requests = _requests(seed=15, n=8)
        SimRunner(_drafter(8, FULL), max_num_reqs=4, ids=ids).run(requests)
        at = [np.cumsum([1] + r.emitted) for r in requests]     # tokens out before each step
        return sum(max(0, len(d) - max(len(r.truth) - a - 1, 0)) for r, o in zip(requests, at)
                   for d, a in zip(r.drafts, o))

    assert past_the_end(ids=False) > 0                          # guard: the last drafts would run past
    assert past_the_end(ids=True) == 0
