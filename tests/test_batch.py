"""Batched lookup decoding: every row equals plain batched greedy generate (transformers' near-tie rule)
and the row generated alone; ragged acceptance, early EOS, hole compaction, sampling per row, bad input."""

import numpy as np
import pytest
import test_sampling as ts
import tiny_models
import torch
from conftest import VOCAB, FlatCosts, chat_ids, lookup_generate, repetitive_prompt

import lookup_decode
from lookup_decode import DecodeStats, Draft, LookupConfig
from lookup_decode.core.cost import CostCurve
from lookup_decode.core.policy import DraftPolicy
from lookup_decode.core.verify import Rules
from lookup_decode.engines.hf.forward import check_batch_memory

NEAR_TIE = 1e-5


@pytest.fixture(scope="module")
def narrow_model():
    """test_sampling's vocabulary-6 Llama: the joint distribution of its first tokens is enumerated exactly."""
    return ts.narrow_llama()


def left_pad(prompts, pad=0):
    """[B, P] ids and mask from 1-D prompts of different lengths, padded on the left like a tokenizer would."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):], mask[i, P - len(p):] = p, 1
    return ids, mask


def mixed_prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [repetitive_prompt(seed * 100 + i, length=int(rng.integers(5, 16)), repeats=int(rng.integers(2, 4)))[0]
            for i in range(n)]


def assert_same_or_near_tie(ours, theirs, logits):
    """Rows of `ours` and `theirs` (generated parts, long [n]) are equal, or differ only after a position where
    the reference's two best logits are within NEAR_TIE (a different reduction order may flip such a choice)."""
    n = min(len(ours), len(theirs))
    diff = np.flatnonzero(np.asarray(ours[:n]) != np.asarray(theirs[:n]))
    if len(diff) == 0:
        assert len(ours) == len(theirs)
        return
    top2 = torch.topk(logits[diff[0]].float(), 2).values
    assert float(top2[0] - top2[1]) < NEAR_TIE, f"rows differ at {diff[0]} without a near-tie"


def plain_batch(model, ids, mask, max_new_tokens, **kw):
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0,
                         return_dict_in_generate=True, output_logits=True, **kw)
    return out.sequences, torch.stack(out.logits, 1)      # [B, P + new], [B, new, V]


def lookup_batch(model, ids, mask, max_new_tokens, stats, **kw):
    """Batched lookup decoding on the adaptive path, priced flat (conftest.FlatCosts: calibrated as usual, but no
    draft is priced out by the load, so the guards on accepted drafts hold); kw: lookup and generate() options."""
    kw.setdefault("costs", FlatCosts())
    return lookup_generate(model, ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                           pad_token_id=0, stats=stats, min_match=1, **kw)


@pytest.mark.parametrize("arch", tiny_models.CORE)
@pytest.mark.parametrize("batch", [1, 2, 5, 8])
def test_batch_equals_plain_batched_generate_and_each_row_alone(arch, batch):
    model = tiny_models.build(arch)
    prompts = mixed_prompts(batch, seed=batch)
    ids, mask = left_pad(prompts)
    stats = DecodeStats()
    ours = lookup_batch(model, ids, mask, 40, stats, eos_token_id=None)
    theirs, logits = plain_batch(model, ids, mask, 40, eos_token_id=None)
    assert ours.shape == theirs.shape
    P = ids.shape[1]
    for b, prompt in enumerate(prompts):
        assert_same_or_near_tie(ours[b, P:].tolist(), theirs[b, P:].tolist(), logits[b])
        alone, alone_logits = plain_batch(model, prompt[None], torch.ones_like(prompt[None]), 40, eos_token_id=None)
        assert_same_or_near_tie(ours[b, P:].tolist(), alone[0, len(prompt):].tolist(), alone_logits[0])
    assert stats.accepted > 0, "guard: drafts were accepted in at least one row"


@pytest.mark.parametrize("arch", tiny_models.CORE)
def test_rows_that_stop_early_are_padded_like_plain_generate(arch):
    model = tiny_models.build(arch)
    prompts = mixed_prompts(5, seed=7)
    ids, mask = left_pad(prompts)
    free, _ = plain_batch(model, ids, mask, 40, eos_token_id=None)
    P = ids.shape[1]
    eos = int(free[0, P + 12])                              # row 0 emits this mid-way: make it the EOS
    stats = DecodeStats()
    ours = lookup_batch(model, ids, mask, 40, stats, eos_token_id=eos)
    theirs, logits = plain_batch(model, ids, mask, 40, eos_token_id=eos)
    assert ours.shape == theirs.shape
    assert (theirs[:, P:] == 0).any(), "guard: some row stopped early and was padded"
    for b in range(len(prompts)):
        assert_same_or_near_tie(ours[b, P:].tolist(), theirs[b, P:].tolist(), logits[b])
    assert stats.accepted > 0


def _record_forwards(model):
    """(rows, cache columns before the step, valid columns of the fullest row) of every forward of `model`,
    by a forward pre-hook (torch's public injection point); call the returned `remove` to take it off."""
    seen = []

    def hook(module, args, kwargs):
        ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")
        if mask is not None and mask.ndim == 2:
            before = mask[:, : mask.shape[1] - ids.shape[1]]
            seen.append((ids.shape[0], before.shape[1], int(before.sum(1).max())))
    return seen, model.register_forward_pre_hook(hook, with_kwargs=True).remove


def _steps_with(model, ids, mask, max_new_tokens, config):
    """(output, [(rows, cache columns, valid columns of the fullest row)] of every verify forward)."""
    seen, remove = _record_forwards(model)
    try:
        hook = lookup_decode.lookup_decoding(config, stats=DecodeStats())
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0,
                             eos_token_id=None, custom_generate=hook)
    finally:
        remove()
    return out, [s for s in seen if s[1] > ids.shape[1]]       # not the prefill or the first step


def test_compaction_every_step_changes_nothing_and_bounds_the_cache(tiny_llama):
    prompts = mixed_prompts(6, seed=3)
    ids, mask = left_pad(prompts)
    theirs, logits = plain_batch(tiny_llama, ids, mask, 60, eos_token_id=None)
    # Fixed draft lengths, so both runs take the same steps: compacting whenever a hole exists vs never.
    ours, steps = _steps_with(tiny_llama, ids, mask, 60, LookupConfig(min_match=1, adaptive=False, hole_share=0.0,
                                                                      min_holes=0))
    _, uncompacted = _steps_with(tiny_llama, ids, mask, 60, LookupConfig(min_match=1, adaptive=False, hole_share=1.0,
                                                                        min_holes=1000))
    P = ids.shape[1]
    for b in range(len(prompts)):
        assert_same_or_near_tie(ours[b, P:].tolist(), theirs[b, P:].tolist(), logits[b])
    # After a step's compaction exactly the fullest row's valid columns remain (rows leaving leave columns
    # behind until the next step compacts them).
    assert all(columns == valid for (rows0, _, _), (rows, columns, valid) in zip(steps, steps[1:]) if rows == rows0)
    assert len(steps) == len(uncompacted)
    assert sum(a[1] < b[1] for a, b in zip(steps, uncompacted)) > 3, "guard: ragged acceptance left holes to compact"


def test_holes_stay_bounded_with_default_thresholds(tiny_llama):
    prompts = mixed_prompts(4, seed=11)
    ids, mask = left_pad(prompts)
    stats = DecodeStats()
    seen, remove = _record_forwards(tiny_llama)
    try:
        lookup_batch(tiny_llama, ids, mask, 150, stats, eos_token_id=None)
    finally:
        remove()
    valid = ids.shape[1] + 150                       # the most columns a row can fill
    config = LookupConfig()
    bound = max(valid + config.min_holes, valid / (1 - config.hole_share)) + 33
    assert max(columns for _, columns, _ in seen) <= bound
    assert stats.accepted > 0


def test_finished_rows_leave_the_batch(tiny_llama):
    prompts = mixed_prompts(5, seed=7)
    ids, mask = left_pad(prompts)
    free, _ = plain_batch(tiny_llama, ids, mask, 40, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 5])
    seen, remove = _record_forwards(tiny_llama)
    try:
        out = lookup_batch(tiny_llama, ids, mask, 40, DecodeStats(), eos_token_id=eos)
    finally:
        remove()
    assert (out[:, -1] == 0).any(), "guard: a row stopped early"
    assert seen[0][0] == 5 and min(rows for rows, _, _ in seen) < 5


def test_repetition_penalty_per_row(tiny_llama):
    prompts = mixed_prompts(4, seed=5)
    ids, mask = left_pad(prompts)
    kw = dict(eos_token_id=None, repetition_penalty=1.3, no_repeat_ngram_size=4)
    theirs, logits = plain_batch(tiny_llama, ids, mask, 30, **kw)
    stats = DecodeStats()
    ours = lookup_batch(tiny_llama, ids, mask, 30, stats, **kw)
    P = ids.shape[1]
    for b in range(len(prompts)):
        assert_same_or_near_tie(ours[b, P:].tolist(), theirs[b, P:].tolist(), logits[b])
    assert stats.accepted > 0, "guard: drafts were accepted"


@pytest.mark.real_model
def test_real_model_batch_equals_plain_batched_generate(real_model):
    model, tok = real_model
    texts = ["Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river bank.",
             "Rewrite with snake_case names:\ndef addNumbers(firstValue, secondValue):\n    totalSum = firstValue + "
             "secondValue\n    return totalSum\n",
             "What is 2 + 2?",
             "List the colours in this sentence: red apples, green pears, yellow bananas and purple plums."]
    prompts = [chat_ids(tok, t)[0] for t in texts]
    ids, mask = left_pad(prompts, pad=tok.pad_token_id)
    kw = dict(do_sample=False, max_new_tokens=48, pad_token_id=tok.pad_token_id)
    ref = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, output_logits=True, **kw)
    logits = torch.stack(ref.logits, 1)
    stats = DecodeStats()
    # adaptive, priced flat (no draft priced out by the load); k=8 keeps the widths a CPU verifies cheaply
    ours = lookup_generate(model, ids, attention_mask=mask, stats=stats, costs=FlatCosts(), k=8, **kw)
    P = ids.shape[1]
    assert ours.shape == ref.sequences.shape
    for b in range(len(texts)):
        assert_same_or_near_tie(ours[b, P:].tolist(), ref.sequences[b, P:].tolist(), logits[b])
    assert stats.accepted > 0


# ---------------------------------------------------------------- sampling: each row its own stream

def _batched_sample_counts(model, gen_kwargs, stats, rules=Rules()):
    """N samples of the first L tokens, 8 rows per call; every row is PROMPT after 2 left pads."""
    ids = torch.cat([torch.zeros(8, 2, dtype=torch.long), ts.PROMPT.expand(8, -1)], 1)
    mask = (torch.arange(ids.shape[1]) >= 2).long().expand(8, -1)
    generator = torch.Generator().manual_seed(3)
    counts = np.zeros(ts.V ** ts.L, dtype=np.int64)
    hook = lookup_decode.lookup_decoding(k=4, min_match=1, adaptive=False, stats=stats, generator=generator,
                                         rules=rules)
    for _ in range(ts.N // 8):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=ts.L, do_sample=True, pad_token_id=0,
                             custom_generate=hook, **gen_kwargs)[:, ids.shape[1]:]
        for row in out.tolist():
            counts[np.ravel_multi_index(row, [ts.V] * ts.L)] += 1
    return counts


@pytest.mark.parametrize("name", ["temperature_0.6_top_k_3", "no_processors"])
def test_batched_sampling_rows_follow_the_exact_distribution(narrow_model, name):
    target = ts.exact_joint(narrow_model, **ts.CONFIGS[name])
    stats = DecodeStats()
    counts = _batched_sample_counts(narrow_model, ts.CONFIGS[name], stats)
    assert ts.chi_square_pvalue(counts, target) > ts.ALPHA
    assert 0 < stats.accepted < stats.drafted, "guard: drafts were both kept and rejected"


def test_batched_sampling_negative_control_is_rejected(narrow_model):
    target = ts.exact_joint(narrow_model, **ts.CONFIGS["temperature_1"])
    rules = Rules(row_by_row=ts._keep_every_draft)
    counts = _batched_sample_counts(narrow_model, ts.CONFIGS["temperature_1"], DecodeStats(), rules)
    assert ts.chi_square_pvalue(counts, target) < ts.ALPHA


# ---------------------------------------------------------------- the width policy and bad input

def relative_cost(curve: CostCurve, rows: int, k: int) -> CostCurve:
    """A batch's curve over widths from a curve over total tokens (rows x w)."""
    return CostCurve(np.arange(1, k + 2), [curve(rows * w) for w in range(1, k + 2)], k + 1, rows=rows)


def test_width_policy_drafts_less_as_the_batch_grows():
    # Synthetic cost: flat up to 16 tokens, then linear (a device saturates): same evidence per row.
    curve = CostCurve([1, 16, 1024], [1.0, 1.0, 64.0], 1024)
    full = Draft(np.arange(32, dtype=np.int32), match_len=8)
    widths = [DraftPolicy(32, relative_cost(curve, rows, 32)).choose([full] * rows) for rows in (1, 4, 16)]
    assert widths[0] > widths[1] > widths[2] >= 1


def test_width_policy_never_drafts_when_nothing_was_proposed():
    cost = relative_cost(CostCurve([1, 64], [1.0, 1.0], 64), 3, 8)
    empty = Draft(np.zeros(0, dtype=np.int32))
    assert DraftPolicy(8, cost).choose([empty] * 3) == 1


def test_bad_batches_get_clear_errors(tiny_llama):
    ids, mask = left_pad(mixed_prompts(3))
    run = dict(max_new_tokens=4, pad_token_id=0, custom_generate=lookup_decode.generate)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        tiny_llama.generate(ids, attention_mask=mask[:, 1:], **run)
    right = torch.flip(mask, [1])
    with pytest.raises(ValueError, match="left padding"):
        tiny_llama.generate(torch.flip(ids, [1]), attention_mask=right, **run)
    with pytest.raises(ValueError, match="only 0"):
        tiny_llama.generate(ids, attention_mask=mask * 2, **run)
    with pytest.raises(ValueError, match="one proposer per row"):
        tiny_llama.generate(ids, attention_mask=mask, proposer=lookup_decode.SuffixIndex(), **run)
    with pytest.raises(ValueError, match="GiB of KV cache"):
        check_batch_memory(tiny_llama, 64, 1000, 32, available_bytes=1 << 20)


def test_batch_with_memory_equals_plain_and_drafts_from_it(tiny_llama):
    from lookup_decode import Memory
    memory = Memory(max_tokens=10_000)
    rng = np.random.default_rng(0)
    prompts = [torch.tensor(rng.integers(3, VOCAB, n), dtype=torch.long) for n in (12, 20, 16)]
    ids, mask = left_pad(prompts)
    theirs, logits = plain_batch(tiny_llama, ids, mask, 40, eos_token_id=None)
    for _ in range(2):                            # the second batch re-asks what the first produced
        ours = lookup_batch(tiny_llama, ids, mask, 40, DecodeStats(), eos_token_id=None, memory=memory)
        for b in range(len(prompts)):
            assert_same_or_near_tie(ours[b, ids.shape[1]:].tolist(), theirs[b, ids.shape[1]:].tolist(), logits[b])
    assert len(memory) == 3
    assert sum(e.accepted for e in memory.entries()) > 0, "guard: rows drafted from memory"


@pytest.mark.parametrize("family", sorted(tiny_models.DECODER_ONLY))
def test_batch_on_every_decoder_only_family(family):
    """Batch of 3 mixed-length prompts: each row equals plain batched generate, or a clear refusal."""
    model = tiny_models.build(family)
    prompts = mixed_prompts(3, seed=2)
    ids, mask = left_pad(prompts)
    theirs, logits = plain_batch(model, ids, mask, 24, eos_token_id=None)
    stats = DecodeStats()
    try:
        ours = lookup_batch(model, ids, mask, 24, stats, eos_token_id=None)
    except ValueError as e:                      # refused before any forward, naming the model
        assert type(model).__name__ in str(e)
        pytest.skip(f"refused: {e}")
    for b in range(len(prompts)):
        assert_same_or_near_tie(ours[b, ids.shape[1]:].tolist(), theirs[b, ids.shape[1]:].tolist(), logits[b])
    assert stats.accepted > 0, "guard: drafts were accepted"


@pytest.mark.parametrize("family", ["mistral_sliding_window", "gemma2"])
def test_batch_with_sliding_window_is_refused(family):
    model = tiny_models.build(family)
    ids, mask = left_pad(mixed_prompts(2))
    with pytest.raises(lookup_decode.UnsupportedCacheError, match=type(model).__name__):
        lookup_batch(model, ids, mask, 8, DecodeStats())
