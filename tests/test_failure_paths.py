"""Issue 16: where plain generate returns, lookup decoding returns the same; where it fails, it fails clearly.

Each test here was written before its fix and failed then (the report of issue 16 lists them).
"""

import numpy as np
import pytest
import tiny_models
import torch
from conftest import VOCAB, FlatCosts, repetitive_prompt

import lookup_decode
from lookup_decode import DecodeStats
from lookup_decode.core.cost import CostModel
from lookup_decode.core.draft import Draft


def short_gpt2(n_positions: int = 64):
    return tiny_models.build("gpt2", n_positions=n_positions)


# --- calibration past the context --------------------------------------------------------------------------

def test_calibration_fits_a_short_context():
    """The issue's example: plain generate fits 58 + 4 tokens in 64 positions; calibration timed up to 33."""
    model = short_gpt2()
    prompt = repetitive_prompt(0, length=18, repeats=3)[:, :58]
    ref = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    got = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0,
                         custom_generate=lookup_decode.generate)
    assert got.tolist() == ref.tolist()


def test_calibration_never_longer_than_needed():
    """With max_new_tokens=4 no verify forward is wider than 4 tokens: nothing wider is timed."""
    model = short_gpt2(1024)
    costs, widths = CostModel(), []
    hook = lookup_decode.lookup_decoding(costs=costs)

    def spy(module, args, kwargs):
        widths.append(kwargs["input_ids"].shape[1])
    model.register_forward_pre_hook(spy, with_kwargs=True)
    prompt = repetitive_prompt(0)
    model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0, custom_generate=hook)
    assert max(widths[1:]) <= 4, widths          # widths[0] is the prefill


def test_batch_calibration_fits_a_short_context():
    model = short_gpt2()
    prompt = repetitive_prompt(0, length=18, repeats=3)[:, :58].repeat(2, 1)
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0
    ref = model.generate(prompt, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    got = lookup_decode.generate(model, prompt, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                 pad_token_id=0)
    assert got.tolist() == ref.tolist()


# --- no max_length-sized allocations ----------------------------------------------------------------------

def test_rows_do_not_allocate_max_length():
    """Plain generate grows its ids as it goes; a huge max_length must not allocate B x max_length up front."""
    rows = lookup_decode.Rows.start(repetitive_prompt(0), 2 ** 40, do_sample=True, generator=torch.Generator())
    assert rows.ids.numel() < 10_000 and rows.uniforms.numel() < 10_000
    assert rows.room(0) == 2 ** 40 - rows.prompt_len - 1


def test_huge_max_length_with_a_stopping_criterion(tiny_llama):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class After(StoppingCriteria):
        def __init__(self, n):
            self.n = n

        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.n, dtype=torch.bool)
    prompt = repetitive_prompt(1)
    stop = StoppingCriteriaList([After(prompt.shape[1] + 300)])
    ref = tiny_llama.generate(prompt, max_length=10 ** 7, do_sample=False, pad_token_id=0, eos_token_id=None,
                              stopping_criteria=stop)
    stats = DecodeStats()
    got = tiny_llama.generate(prompt, max_length=10 ** 7, do_sample=False, pad_token_id=0, eos_token_id=None,
                              stopping_criteria=stop,
                              custom_generate=lookup_decode.lookup_decoding(stats=stats, costs=FlatCosts()))
    assert got.tolist() == ref.tolist() and stats.accepted > 0


# --- proposer output validated ----------------------------------------------------------------------------

class WrongIds:
    """A user's drafter that proposes a token id the model does not have."""

    def __init__(self, token):
        self.token = token

    def extend(self, tokens):
        pass

    def propose(self, max_tokens):
        return Draft(np.full(min(max_tokens, 3), self.token, np.int32))


@pytest.mark.parametrize("token", [VOCAB + 5, -1])
def test_proposer_token_outside_vocabulary(tiny_llama, token):
    with pytest.raises(ValueError, match=r"WrongIds.propose.*outside the vocabulary \[0, 96\)"):
        tiny_llama.generate(repetitive_prompt(0), max_new_tokens=8, do_sample=False, pad_token_id=0,
                            custom_generate=lookup_decode.generate, proposer=WrongIds(token), adaptive=False)


# --- streamer.end() on every way out ----------------------------------------------------------------------

class Failing:
    def __init__(self, after):
        self.after, self.calls = after, 0

    def extend(self, tokens):
        pass

    def propose(self, max_tokens):
        self.calls += 1
        if self.calls > self.after:
            raise KeyboardInterrupt
        return Draft(np.zeros(0, np.int32))


class Streamer:
    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, value):
        self.tokens.append(value)

    def end(self):
        self.ended = True


def test_streamer_ends_when_decoding_is_interrupted(tiny_llama):
    streamer = Streamer()
    with pytest.raises(KeyboardInterrupt):
        lookup_decode.generate(tiny_llama, repetitive_prompt(0), max_new_tokens=8, do_sample=False, pad_token_id=0,
                               streamer=streamer, proposer=Failing(2), adaptive=False)
    assert streamer.ended


# --- NaN / inf probabilities refused (torch.multinomial raises in plain sampling) -------------------------

class NanScores:
    def __call__(self, input_ids, scores):
        return torch.full_like(scores, float("nan"))


def test_nan_probabilities_refused(tiny_llama):
    from transformers import LogitsProcessorList
    prompt = repetitive_prompt(0)
    kw = dict(max_new_tokens=4, do_sample=True, pad_token_id=0, logits_processor=LogitsProcessorList([NanScores()]))
    with pytest.raises(RuntimeError):
        tiny_llama.generate(prompt, **kw)
    with pytest.raises(ValueError, match="nan or inf"):
        tiny_llama.generate(prompt, custom_generate=lookup_decode.generate, adaptive=False, **kw)


def test_nan_probabilities_refused_without_processors():
    from lookup_decode.core.verify import sample_rows
    probs = torch.full((2, 5), float("nan"))
    with pytest.raises(ValueError, match="nan or inf"):
        sample_rows(probs, torch.rand(2, dtype=torch.float64))


# --- output_scores: one row per tensor, not views of a whole verify block ---------------------------------

def test_scores_are_copies(tiny_llama):
    stats = DecodeStats()
    out = tiny_llama.generate(repetitive_prompt(0), max_new_tokens=30, do_sample=False, pad_token_id=0,
                              eos_token_id=None, return_dict_in_generate=True, output_scores=True, output_logits=True,
                              custom_generate=lookup_decode.generate, stats=stats, adaptive=False)
    assert stats.accepted > 0
    for t in (*out.scores, *out.logits):
        assert t.shape == (1, VOCAB) and t.untyped_storage().nbytes() == VOCAB * t.element_size()


# --- bounded stats ----------------------------------------------------------------------------------------

def test_stats_lists_are_bounded():
    stats = DecodeStats(keep_steps=1000)
    for i in range(5000):
        stats.observe(3, i % 4 if i % 4 < 3 else 3)
    assert stats.steps == 5000 and stats.drafted == 15000
    assert len(stats.draft_lengths) <= 1000 and len(stats.accepted_lengths) <= 1000
    assert stats.draft_lengths[-1] == 3 and stats.accepted_lengths[-1] == 3


# --- stop strings ending in a multi-byte character ----------------------------------------------------------

class ByteTokenizer:
    """Byte-level tokens (id = byte), as byte-level BPE splits a character it has no merge for."""

    def decode(self, ids, **kwargs):
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("stop", ["。", "🙂", "end。"])
def test_stop_string_ending_in_a_multibyte_character(stop):
    from lookup_decode.engines.hf.stopping import StopStrings
    criterion = StopStrings(ByteTokenizer(), [stop])
    text = list(("some text " + stop).encode())
    hits = [bool(criterion(torch.tensor([text[:j + 1]]))[0]) for j in range(len(text))]
    assert hits.index(True) == len(text) - 1 and sum(hits) == 1


# --- trees exact or refused on every cache family -----------------------------------------------------------

@pytest.mark.parametrize("family", sorted(__import__("tiny_models").WINDOWED))
def test_trees_on_windowed_and_conv_caches_are_exact(family):
    """A tree's 4-D mask ignores a sliding window and a conv layer sees nodes as one sequence: such caches
    verify the tree's first branch (a chain) instead, and the output is plain's."""
    import tiny_models
    model = tiny_models.build(family)
    prompt = repetitive_prompt(3, length=12, repeats=4)           # longer than the window (24)
    kw = dict(max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=None)
    ref = model.generate(prompt, **kw)
    stats = DecodeStats()
    got = model.generate(prompt, custom_generate=lookup_decode.generate, proposer=lookup_decode.TreeProposer(width=3),
                         stats=stats, adaptive=False, **kw)
    assert got.tolist() == ref.tolist()
    assert stats.accepted > 0


# --- batch memory check: logits counted, free memory read as the OS reports it ----------------------------

def test_batch_memory_check_counts_the_logits(tiny_llama):
    from lookup_decode.engines.hf.forward import batch_memory_bytes, check_batch_memory
    kv = batch_memory_bytes(tiny_llama, 8, 200, 32, logits=False)
    with_logits = batch_memory_bytes(tiny_llama, 8, 200, 32)
    assert with_logits - kv == 8 * 33 * VOCAB * 4        # float32 [B, k + 1, V] of one verify forward
    with pytest.raises(ValueError, match="GiB"):
        check_batch_memory(tiny_llama, 8, 200, 32, available_bytes=(kv + with_logits) // 2)


def test_free_cpu_memory_counts_reclaimable_cache():
    """SC_AVPHYS_PAGES leaves out the page cache the OS gives back on demand: it refused batches that fit."""
    import os

    from lookup_decode.engines.hf.forward import _free_memory
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    free = _free_memory(torch.device("cpu"))
    assert abs(free - available) < 0.05 * available + (64 << 20)
    assert free >= os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 0.95


# --- Draft: ids past int32 refused, not wrapped; the caller's buffer copied ---------------------------------

def test_draft_refuses_ids_past_int32():
    with pytest.raises(ValueError, match="int32"):
        Draft(np.array([5, 2 ** 32 + 5], np.int64))


def test_draft_copies_the_callers_buffer():
    buffer = np.array([4, 5, 6], np.int32)
    draft = Draft(buffer)
    buffer[:] = 0
    assert draft.tokens.tolist() == [4, 5, 6]


# --- static caches with conv layers: refused (the fuzzer found wrong tokens at max_cache_len >= 512) ---------

def test_static_cache_with_conv_layers_is_refused():
    """Found by tests/stress/fuzz.py (seed 1, case 181): LFM2 (conv + attention layers) on a StaticCache of
    1024 positions gave other tokens than plain generate (from 256 positions up; exact at 100). Refused
    clearly until its rollback is exact."""
    import tiny_models
    from transformers import StaticCache
    model = tiny_models.build("lfm2")
    prompt = repetitive_prompt(1)
    cache = StaticCache(config=model.config, max_cache_len=1024)
    with pytest.raises(lookup_decode.UnsupportedCacheError, match="static cache"):
        model.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0, past_key_values=cache,
                       custom_generate=lookup_decode.generate, adaptive=False)


# --- found by the fuzzer (seed 2): positions of padding columns, calibration with no room -------------------

class Oracle:
    """Drafts the known continuation: its row runs ahead of a row whose drafts are all rejected."""

    def __init__(self, tokens, per_step):
        self.tokens, self.n, self.per_step = list(tokens), 0, per_step

    def extend(self, tokens):
        self.n += len(tokens)

    def propose(self, max_tokens):
        return Draft(np.array(self.tokens[self.n: self.n + min(max_tokens, self.per_step)], np.int32))


class Fives:
    def extend(self, tokens):
        pass

    def propose(self, max_tokens):
        return Draft(np.full(min(max_tokens, 4), 5, np.int32))


def test_batch_padding_columns_stay_inside_the_context():
    """Seed 2, case 1285: a row that drafts nothing near the context end shares a forward with a row that drafts
    4 tokens; its padding columns' positions ran past GPT-2's 64 positions (IndexError in the embedding)."""
    model = short_gpt2(64)
    rng = np.random.default_rng(0)
    ids = torch.tensor(rng.integers(3, VOCAB, (2, 50)))
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    kw = dict(attention_mask=mask, max_new_tokens=13, do_sample=False, pad_token_id=0, eos_token_id=None)
    ref = model.generate(ids, **kw)
    stats = DecodeStats()
    got = model.generate(ids, custom_generate=lookup_decode.generate, proposer=[Oracle(ref[0].tolist(), 1), Fives()],
                         adaptive=False, k=8, stats=stats, **kw)
    assert got.tolist() == ref.tolist() and stats.accepted > 0


def test_static_cache_with_one_new_token_and_adaptive():
    """Seed 2, case 189: max_new_tokens=1 on a static cache sized to the prompt: calibration ran a forward into a
    full cache (index_copy_ out of bounds). No step can follow the prefill there, so nothing is calibrated."""
    model = short_gpt2(1024)
    prompt = repetitive_prompt(2)
    kw = dict(max_new_tokens=1, do_sample=False, pad_token_id=0, cache_implementation="static")
    ref = model.generate(prompt, **kw)
    costs = CostModel()
    got = model.generate(prompt, custom_generate=lookup_decode.lookup_decoding(costs=costs), **kw)
    assert got.tolist() == ref.tolist() and costs.known(model) == {}
