"""The cost model: one curve type (seconds per forward of rows x width), timed on a grid of widths on a cold start
(no assumption about the device or dtype), refined online, and cached on disk."""

import numpy as np
import pytest
import torch

import lookup_decode
from lookup_decode.core.cost import CACHE_ENV, SAVE_EVERY, CostCurve, CostModel, calibration_widths
from lookup_decode.core.stats import DecodeStats


def linear(calls):
    def seconds_of(n):
        calls.append(n)
        return 1.0 + 0.5 * n
    return seconds_of


def test_cold_curve_times_the_grid_twice_and_goes_through_it():
    calls = []
    curve = CostCurve.from_timings(linear(calls), 33)
    assert sorted(set(calls)) == [1, 2, 4, 8, 16, 33] and len(calls) == 12
    assert calls[0] == 33                                   # widest first: its allocations serve the others
    assert all(curve(w) == pytest.approx(1.0 + 0.5 * w) for w in range(1, 34))
    assert curve.max_w == 33


def test_cold_curve_keeps_the_least_of_two_timings():
    readings = iter([5.0, 1.0, 1.0, 9.0])                 # widths 2, 1, then again 2, 1
    curve = CostCurve.from_timings(lambda w: next(readings), 2)
    assert (curve(1), curve(2)) == (1.0, 1.0)


def test_cold_curve_times_only_allowed_sizes():
    calls = []
    curve = CostCurve.from_timings(linear(calls), 33, sizes=[1, 2, 4, 8, 16, 32])
    assert set(calls) == {1, 2, 4, 8, 16, 32} and curve.max_w == 33 and curve(33) == curve(32)
    assert calibration_widths(12) == [1, 2, 4, 8, 12] and calibration_widths(1) == [1]


def test_a_bf16_like_curve_is_kept_as_measured():
    """The shape comes from the timings alone: a curve where 4 tokens cost less than 1 (bf16 kernels on a CPU,
    issue 32's measurement) is not bent toward any prior."""
    rel = {1: 1.0, 2: 0.93, 4: 0.84, 8: 0.92, 16: 1.13, 33: 1.57}
    curve = CostCurve.from_timings(lambda w: 0.076 * rel[w], 33)
    assert curve(4) < curve(1) and curve(16) / curve(1) == pytest.approx(1.13)


def test_one_error_type_for_widths_the_curve_does_not_cover():
    curve = CostCurve([1, 8], [1.0, 2.0], 8)
    for bad in (lambda: curve(9), lambda: curve(0), lambda: curve.prices(9), lambda: CostCurve([1], [0.0], 4)):
        with pytest.raises(ValueError):
            bad()


def test_a_curve_learns_from_its_own_rows_only():
    curve = CostCurve([1, 3], [1.0, 1.4], 3, rows=8)
    curve.observe(4, 2, 5.0)                 # another batch size: another curve's business
    assert curve(2) == 1.2
    for _ in range(200):
        curve.observe(8, 1, 1.0)
        curve.observe(8, 2, 2.0)             # truly twice a width-1 forward
    assert curve(2) / curve(1) == pytest.approx(2.0, rel=0.02)


def test_curve_is_cached_on_disk_per_model_config(tiny_llama, tmp_path):
    first = CostModel(tmp_path)
    calls = []
    curve = first.curve(tiny_llama, 33, linear(calls))
    assert calls and len(list(tmp_path.glob("*.json"))) == 1

    def never(n):
        raise AssertionError("a cached curve must not be measured again")
    again = CostModel(tmp_path).curve(tiny_llama, 33, never)     # a new process, say
    assert np.allclose(again.per_width, curve.per_width)
    # A different dtype is a different curve.
    other = CostModel(tmp_path)
    calls.clear()
    other.curve(tiny_llama.to(torch.float64), 33, linear(calls))
    tiny_llama.to(torch.float32)
    assert calls


def test_env_var_moves_the_cache_and_off_disables_it(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "elsewhere"))
    CostModel().curve(tiny_llama, 33, linear([]))
    assert len(list((tmp_path / "elsewhere").glob("*.json"))) == 1
    monkeypatch.setenv(CACHE_ENV, "off")
    calls = []
    CostModel().curve(tiny_llama, 33, linear(calls))
    assert calls                       # nothing read from disk


def test_reset_forgets_memory_and_optionally_disk(tiny_llama, tmp_path):
    costs = CostModel(tmp_path)
    costs.curve(tiny_llama, 33, linear([]))
    costs.reset()
    assert costs.known(tiny_llama) == {}
    assert list(tmp_path.glob("*.json"))
    costs.reset(disk=True)
    assert not list(tmp_path.glob("*.json"))


def test_refined_curve_is_saved_after_enough_steps(tiny_llama, tmp_path):
    costs = CostModel(tmp_path)
    curve = costs.curve(tiny_llama, 33, linear([]))
    for _ in range(SAVE_EVERY):
        curve.observe(1, 4, 10.0)        # size 4 turns out far dearer than measured
    costs.save(tiny_llama, curve)
    stored = CostModel(tmp_path).curve(tiny_llama, 33, linear([]))
    assert stored(4) == pytest.approx(curve(4)) and stored(4) > 1.0 + 0.5 * 4


def test_second_process_pays_no_calibration_forwards(tiny_llama, tmp_path):
    """End to end: the first call's few calibration forwards are not paid again by a new CostModel."""
    forwards = []
    handle = tiny_llama.register_forward_hook(lambda *a: forwards.append(1))
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]])
    extra, outs = [], []
    try:
        for _ in range(2):
            forwards.clear()
            stats = DecodeStats()
            hook = lookup_decode.lookup_decoding(costs=CostModel(tmp_path), stats=stats)
            outs.append(tiny_llama.generate(prompt, max_new_tokens=20, do_sample=False, custom_generate=hook,
                                            eos_token_id=None, pad_token_id=0))
            extra.append(len(forwards) - stats.steps - 1)      # forwards besides the prefill and the steps
    finally:
        handle.remove()
    assert outs[0].tolist() == outs[1].tolist()
    assert extra == [2 * len(calibration_widths(19)), 0]
    # A new process asking for what the call needed (its widest forward: 20 new tokens after 17 -> 19 wide)
    # gets the curve from disk without timing anything (seconds_of=None would raise if it were called).
    assert isinstance(CostModel(tmp_path).curve(tiny_llama, 33, None, fit=19), CostCurve)


def test_batch_calibration_times_the_grid_and_follows_it(tiny_llama, tmp_path):
    # A cold batch times its own rows x w forwards on the grid (each twice); the curve goes through them.
    calls = []
    costs = CostModel(tmp_path)
    cost = costs.curve(tiny_llama, 33, linear(calls), rows=16)
    assert sorted(set(calls)) == [1, 2, 4, 8, 16, 33] and len(calls) == 12
    assert cost.rows == 16 and all(np.isclose(cost(w), 1 + 0.5 * w) for w in range(1, 34))
    # Each batch call gets its own copy (its scale is its own); one sequence shares the live curve.
    assert costs.curve(tiny_llama, 33, None, rows=16) is not cost


@pytest.mark.parametrize("regime, q, chosen", [
    ("bf16", 0.9, range(16, 18)), ("bf16", 0.2, range(2, 6)),  # 16 tokens at 1.13x one: long drafts; 4 cost < 1
    ("fp32", 0.2, [1])])                                      # float32: a weak draft is not worth a forward
def test_the_timed_curve_sets_the_draft_length(regime, q, chosen):
    """Issue 32's measured curves (relative seconds of one forward over n tokens, 0.5B, 2 threads, this CPU),
    timed as a cold start times them, priced by the draft policy for a draft whose tokens are each kept with
    probability q. The model-size prior this replaced priced the bf16 16-token forward at 1.49x and chose 8."""
    from lookup_decode.core.draft import Draft
    from lookup_decode.core.policy import DraftPolicy
    widths = [1, 2, 4, 8, 16, 32]
    rel = {"bf16": [1.0, 0.93, 0.84, 0.92, 1.13, 1.55], "fp32": [1.0, 1.99, 1.63, 1.56, 1.86, 2.60]}[regime]
    curve = CostCurve.from_timings(lambda w: float(np.interp(w, widths, rel)), 33)
    p = np.cumprod(np.full((1, 32), q), axis=1)
    assert DraftPolicy(32, curve).choose([Draft(np.arange(32), 4)], p=p) in chosen


@pytest.mark.parametrize("rows", [1, 3])
def test_a_warm_up_leaves_no_calibration_to_the_timed_call(tiny_llama, rows):
    """A call times only the widths it can run (max_new_tokens - 1): the CLI's and the benchmarks' 4-16 token
    warm-ups left the whole calibration to the first timed call (0.7 s of the README job's 5 s). `warm_up` runs
    long enough (`calibrating_tokens`) that the timed call finds its curve (the same one, not a re-timed one)."""
    from lookup_decode.core.cost import calibrating_tokens
    from lookup_decode.measure import Variant, warm_up

    ids = torch.randint(3, 96, (rows, 40), generator=torch.Generator().manual_seed(0))
    costs, key = lookup_decode.COSTS, CostModel.key(tiny_llama, rows)

    def call(n):
        tiny_llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                            pad_token_id=0, custom_generate=lookup_decode.generate)
        return costs.known(tiny_llama)[key]
    costs.reset(tiny_llama, disk=True)           # (the test's own disk cache, too)
    try:
        short = call(4)
        assert call(60) is not short                 # the bug: the timed call re-timed every width
        costs.reset(tiny_llama, disk=True)
        if rows == 1:
            warm_up(tiny_llama, ids, Variant("lookup_decode", lookup={}), 60)
            warmed = costs.known(tiny_llama)[key]
        else:
            warmed = call(calibrating_tokens(32))
        assert call(60) is warmed
    finally:
        costs.reset(tiny_llama)


def test_a_warm_up_teaches_the_timed_call_nothing(tiny_llama):
    """`warm_up` decodes the start of the answer its timed runs decode: what it taught the acceptance model is
    forgotten, so the first timed run prices its drafts as a fresh process's first call does (the benchmarks'
    first prompt was priced by its own answer)."""
    from lookup_decode.engines.hf import hook
    from lookup_decode.measure import Variant, warm_up

    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11] * 8])
    hook.forget_acceptance(tiny_llama)
    run_variant = lookup_decode.measure.run_variant
    learned = []

    def spy(model, *args, **kwargs):
        run = run_variant(model, *args, **kwargs)
        learned.append(float(hook._POOLS[model].sum()) if model in hook._POOLS else 0.0)
        return run
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lookup_decode.measure, "run_variant", spy)
        warm_up(tiny_llama, ids, Variant("lookup_decode", lookup={}), 60)
    assert learned and learned[0] > 0               # it did learn (drafts were sent and checked)
    assert tiny_llama not in hook._POOLS
