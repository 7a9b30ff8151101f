"""Encoder-decoder models (BART, T5, Pegasus, Marian): lookup decoding == plain greedy generate.

Drafts come from the encoder's input ids and the decoder's own output; the decoder verifies them with
its cross-attention cache, and only the self-attention half of the EncoderDecoderCache rolls back.
"""

import numpy as np
import pytest
import tiny_models
import torch
from conftest import FlatCosts, lookup_generate, repetitive_prompt
from test_model_coverage import assert_same_greedy
from transformers.generation.utils import GenerateEncoderDecoderOutput

import lookup_decode
from lookup_decode import DecodeStats, SuffixIndex

N_NEW = 40


def plain(model, source, n_new=N_NEW, **kw):
    return model.generate(source, do_sample=False, eos_token_id=None, max_new_tokens=n_new,
                          return_dict_in_generate=True, output_logits=True, **kw)


def lookup(model, source, stats, n_new=N_NEW, **kw):
    """Lookup decoding, greedy; kw: lookup options and generate()'s, and costs= (see conftest.lookup_generate)."""
    kw.setdefault("min_match", 1)
    return lookup_generate(model, source, do_sample=False, eos_token_id=None, max_new_tokens=n_new, stats=stats,
                           **kw)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(tiny_models.ENCODER_DECODER))
def test_equals_plain_greedy(name, seed):
    model = tiny_models.build(name)
    source = repetitive_prompt(seed, length=16)
    ref = plain(model, source)
    # Fixed drafts, then the defaults (adaptive), priced flat so that no draft is priced out by the load.
    for options in (dict(k=8, adaptive=False), dict(costs=FlatCosts())):
        stats = DecodeStats()
        got = lookup(model, source, stats, **options)
        assert_same_greedy(ref, got, 1)                        # decoder prompt: [decoder_start]
        assert stats.accepted > 0


class SpyIndex(SuffixIndex):
    def __init__(self):
        self.seen: list[list[int]] = []
        super().__init__(min_match=1)

    def extend(self, tokens):
        if len(tokens):
            self.seen.append([int(t) for t in tokens])
        super().extend(tokens)


def test_source_is_indexed_before_the_decoder_prompt():
    model = tiny_models.build("t5")
    source = repetitive_prompt(0, length=16)
    spy = SpyIndex()
    lookup(model, source, DecodeStats(), n_new=8, proposer=spy)
    assert spy.seen[0] == source[0].tolist()
    assert spy.seen[1] == [model.config.decoder_start_token_id]


@pytest.fixture(scope="module")
def copier():
    return tiny_models.bart_copier()


def test_summary_that_quotes_its_article(copier):
    """A BART that copies its input (a summarizer quoting the article): drafts from the source are accepted."""
    rng = np.random.default_rng(7)
    article = torch.tensor(rng.choice(np.arange(3, tiny_models.VOCAB), size=40, replace=False))[None]  # no repeats
    ref = plain(copier, article)
    assert (ref.sequences[0, 1:21] == article[0, :20]).float().mean() > 0.5     # the model really quotes
    stats = DecodeStats()
    got = lookup(copier, article, stats, k=8, adaptive=False)
    assert_same_greedy(ref, got, 1)
    # Nothing repeats in the article, so long accepted runs can only come from copying the source.
    assert stats.accepted >= N_NEW // 2
    assert stats.steps <= N_NEW // 2


def test_return_dict_and_scores(copier):
    article = repetitive_prompt(3, length=16)
    ref = copier.generate(article, do_sample=False, eos_token_id=None, max_new_tokens=20,
                          return_dict_in_generate=True, output_scores=True)
    got = copier.generate(article, do_sample=False, eos_token_id=None, max_new_tokens=20, min_match=1,
                          return_dict_in_generate=True, output_scores=True, custom_generate=lookup_decode.generate)
    assert isinstance(got, GenerateEncoderDecoderOutput)
    assert got.sequences.tolist() == ref.sequences.tolist()
    assert len(got.scores) == len(ref.scores) == 20
    for a, b in zip(got.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert got.cache.get_seq_length() == got.sequences.shape[1] - 1


def test_draft_model_proposer_refused():
    from lookup_decode.engines.hf.draft_model import DraftModelProposer
    model = tiny_models.build("bart")
    draft = DraftModelProposer(tiny_models.build("llama"))
    with pytest.raises(ValueError, match="BartForConditionalGeneration: draft-model proposers"):
        lookup(model, repetitive_prompt(0), DecodeStats(), n_new=4, proposer=draft)


def test_direct_call_and_static_cache_with_return_dict():
    model = tiny_models.build("bart")
    source = repetitive_prompt(1, length=16)
    ref = plain(model, source, n_new=24)
    got = lookup_decode.generate(model, source, max_new_tokens=24, do_sample=False, eos_token_id=None, min_match=1)
    assert got.tolist() == ref.sequences.tolist()
    out = lookup(model, source, DecodeStats(), n_new=24, cache_implementation="static", return_dict_in_generate=True)
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert int(out.cache.get_seq_length()) == out.sequences.shape[1] - 1


@pytest.mark.parametrize("name", ["bart", "t5"])
def test_encoder_attention_mask_is_not_the_decoders(name):
    """A tokenizer's attention_mask covers the encoder input (padded or not), never the decoder's ids."""
    model = tiny_models.build(name)
    source = repetitive_prompt(2, length=16)
    mask = torch.ones_like(source)
    mask[0, :3] = 0                                            # a left-padded source is still one row
    for m in (torch.ones_like(source), mask):
        ref = plain(model, source, attention_mask=m)
        stats = DecodeStats()
        got = lookup(model, source, stats, attention_mask=m, k=8, adaptive=False)
        assert_same_greedy(ref, got, 1)
        assert stats.accepted > 0
