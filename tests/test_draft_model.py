"""Drafts with a distribution: a small Transformers draft model through the same loop and verifier."""

import pytest
import torch
from conftest import repetitive_prompt
from test_sampling import CONFIGS, NARROW, PROMPT, L, V, exact_joint, sample_counts
from test_verify import ALPHA, chi_square_pvalue
from tiny_models import build

import lookup_decode
from lookup_decode import DecodeStats, DraftModelProposer
from lookup_decode.core.verify import Rules


def tiny_llama(vocab, seed, device="cpu"):
    """A 1-layer draft model of the sampling tests' narrow Llama (test_sampling.NARROW) over `vocab` tokens."""
    return build("llama", seed, device=device, **{**NARROW, "vocab_size": vocab}, num_hidden_layers=1,
                 max_position_embeddings=256)


def test_same_model_as_draft_accepts_everything_greedy():
    target = build("llama", seed=2)
    prompt = repetitive_prompt(3)
    ref = target.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
    stats = DecodeStats()
    got = target.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0,
                          custom_generate=lookup_decode.generate, stats=stats, k=4, adaptive=False,
                          proposer=DraftModelProposer(target, do_sample=False))
    assert got.tolist() == ref.tolist()
    assert stats.acceptance_rate == 1.0 and stats.draft_lengths[:5] == [4] * 5


def test_other_draft_model_greedy_is_exact():
    target = build("llama", seed=2)
    draft_model = build("llama", seed=3)
    prompt = repetitive_prompt(4)
    ref = target.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
    stats = DecodeStats()
    got = target.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0,
                          custom_generate=lookup_decode.generate, stats=stats, k=3, adaptive=False,
                          proposer=DraftModelProposer(draft_model, do_sample=False))
    assert got.tolist() == ref.tolist()
    assert stats.drafted > 0


def test_a_draft_model_with_a_recurrent_state_is_refused():
    """Its drafts are cropped one forward at a time, which a recurrent state cannot undo: a clear error."""
    target = build("llama", seed=2)
    with pytest.raises(lookup_decode.UnsupportedCacheError, match="draft model with a recurrent state"):
        target.generate(repetitive_prompt(4), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
                        custom_generate=lookup_decode.generate, k=3, adaptive=False,
                        proposer=DraftModelProposer(build("jamba"), do_sample=False))


@pytest.fixture(scope="module")
def target():
    return tiny_llama(V, seed=0)


def draft_sampler(draft_model, stats, seed, rules=Rules()):
    generator = torch.Generator().manual_seed(seed)

    def run(model, **gen_kwargs):
        proposer = DraftModelProposer(draft_model, do_sample=True, temperature=1.3, generator=generator)
        hook = lookup_decode.lookup_decoding(k=2, adaptive=False, stats=stats, generator=generator, proposer=proposer,
                                             rules=rules)
        return model.generate(PROMPT, max_new_tokens=L, do_sample=True, custom_generate=hook, **gen_kwargs)
    return run


def test_draft_model_sampling_matches_the_exact_target(target):
    # The draft model differs from the target, so q puts mass where p has little or none (top-k).
    gen_kwargs = CONFIGS["temperature_0.6_top_k_3"]
    joint = exact_joint(target, **gen_kwargs)
    stats = DecodeStats()
    counts = sample_counts(target, draft_sampler(tiny_llama(V, seed=9), stats, seed=1), **gen_kwargs)
    assert chi_square_pvalue(counts, joint) > ALPHA
    assert 0 < stats.accepted < stats.drafted


def test_draft_model_negative_control(target):
    def no_residual(draft, probs, draft_probs, generator=None):
        x = int(draft[0])
        u = torch.rand((), generator=generator, dtype=torch.float64)
        if u * draft_probs[0, x] < probs[0, x]:
            return draft[:1]
        return torch.multinomial(probs[0].double(), 1, generator=generator)   # p itself, not max(0, p - q)

    gen_kwargs = CONFIGS["temperature_0.6_top_k_3"]
    joint = exact_joint(target, **gen_kwargs)
    sampler = draft_sampler(tiny_llama(V, seed=9), DecodeStats(), seed=1, rules=Rules(draft_probs=no_residual))
    counts = sample_counts(target, sampler, **gen_kwargs)
    assert chi_square_pvalue(counts, joint) < ALPHA


def test_draft_model_with_another_vocabulary_is_refused(target):
    with pytest.raises(ValueError, match="vocabulary .*tokenizer"):
        target.generate(PROMPT, max_new_tokens=4, do_sample=True, custom_generate=lookup_decode.generate,
                        proposer=DraftModelProposer(tiny_llama(V + 3, seed=1)))


def test_draft_model_on_another_device_is_refused(target):
    elsewhere = tiny_llama(V, seed=1, device="meta")
    with pytest.raises(ValueError, match="draft model is on meta"):
        target.generate(PROMPT, max_new_tokens=4, do_sample=True, custom_generate=lookup_decode.generate,
                        proposer=DraftModelProposer(elsewhere))


@pytest.mark.parametrize("kw, message", [(dict(temperature=0.0), "temperature"),
                                         (dict(temperature=-1.0), "temperature"),
                                         (dict(top_p=1.5), "top_p"), (dict(top_p=0.0), "top_p")])
def test_invalid_sampling_values(target, kw, message):
    with pytest.raises(ValueError, match=message):
        target.generate(PROMPT, max_new_tokens=4, do_sample=True, custom_generate=lookup_decode.generate, **kw)
