"""Lossless sampling end to end: the joint distribution of the first tokens sampled through
model.generate(custom_generate=lookup_decode.generate) equals the model's own sampling distribution.

The target distribution is exact, not estimated: with a 6-token vocabulary the first 3 tokens have
216 outcomes, and their probabilities are computed by enumerating every prefix with the very logits
processors transformers builds for the request. Observed counts are compared with a chi-square
goodness-of-fit test at ALPHA = 1e-3 on N = 2,000 samples (seeded, so each outcome is fixed). The
same harness must reject deliberately wrong acceptance rules (negative controls).
"""

import itertools

import numpy as np
import pytest
import tiny_models
import torch
from test_verify import ALPHA, chi_square_pvalue

import lookup_decode
from lookup_decode import DecodeStats
from lookup_decode.core.verify import Rules, sample_rows

V, L, N = 6, 3, 2000
# The model's own greedy loop, repeated: the index drafts what the model tends to say.
PROMPT = torch.tensor([[1, 2, 3, 2, 5, 0, 0, 0, 0, 1, 2, 3, 2, 5]])


# The tiny Llama narrowed to V tokens (no special ids), so every outcome of L tokens can be enumerated.
NARROW = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
              initializer_range=0.3, pad_token_id=None, bos_token_id=None, eos_token_id=None)


def narrow_llama():
    """The tiny Llama over V tokens (NARROW); other test modules build it for their own fixture."""
    return tiny_models.build("llama", max_position_embeddings=64, **NARROW)


@pytest.fixture(scope="module")
def model():
    return narrow_llama()


def processors_for(model, **gen_kwargs):
    """The LogitsProcessorList transformers prepares for this request (captured via custom_generate)."""
    captured = {}

    def capture(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
        captured["processors"] = logits_processor
        return input_ids

    model.generate(PROMPT, custom_generate=capture, max_new_tokens=L, do_sample=True, **gen_kwargs)
    return captured["processors"]


@torch.inference_mode()
def exact_joint(model, **gen_kwargs) -> np.ndarray:
    """P(x_1, .., x_L) under plain sampling, float64 [V ** L], by enumerating all prefixes."""
    processors = processors_for(model, **gen_kwargs)

    def next_probs(prefix):
        ids = torch.cat([PROMPT, torch.tensor([prefix], dtype=torch.long).view(1, -1)], dim=1)
        scores = processors(ids, model(ids).logits[:, -1].float())
        return torch.softmax(scores, -1)[0].double().numpy()

    joint = np.zeros([V] * L)
    for prefix in itertools.product(range(V), repeat=L - 1):
        p = 1.0
        for j in range(L - 1):
            p *= next_probs(list(prefix[:j]))[prefix[j]]
        if p > 0:
            joint[prefix] = p * next_probs(list(prefix))
    assert joint.sum() == pytest.approx(1.0, abs=1e-6)
    return joint.ravel()


def sample_counts(model, sampler, **gen_kwargs):
    counts = np.zeros(V ** L, dtype=np.int64)
    for _ in range(N):
        out = sampler(model, **gen_kwargs)[0, PROMPT.shape[1]:].tolist()
        assert len(out) == L
        counts[np.ravel_multi_index(out, [V] * L)] += 1
    return counts


def lookup_sampler(stats, generator, rules=Rules(), **options):
    """rules: the acceptance rules (a negative control swaps in a wrong one); options: more lookup options."""
    hook = lookup_decode.lookup_decoding(k=4, min_match=1, adaptive=False, stats=stats, generator=generator,
                                         rules=rules, **options)

    def run(model, **gen_kwargs):
        return model.generate(PROMPT, max_new_tokens=L, do_sample=True, custom_generate=hook, **gen_kwargs)
    return run


CONFIGS = {
    "temperature_1": dict(temperature=1.0),
    "temperature_0.6_top_k_3": dict(temperature=0.6, top_k=3),      # top-k often excludes the draft token
    "top_p_0.7": dict(top_p=0.7),
    "repetition_penalty": dict(temperature=0.9, repetition_penalty=1.5),
    "top_k_1": dict(top_k=1),                                        # p(d) in {0, 1}: a point mass
    "no_processors": dict(temperature=1.0, top_k=0),                 # raw softmax: the vectorized rule
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_joint_distribution_matches_plain_sampling(model, name):
    gen_kwargs = CONFIGS[name]
    target = exact_joint(model, **gen_kwargs)
    stats = DecodeStats()
    counts = sample_counts(model, lookup_sampler(stats, torch.Generator().manual_seed(1)), **gen_kwargs)
    assert chi_square_pvalue(counts, target) > ALPHA
    assert stats.accepted > 0, "guard: drafts were kept"
    if name != "top_k_1":
        assert stats.accepted < stats.drafted, "guard: drafts were also rejected"


def test_plain_generate_sampling_matches_the_exact_target(model):
    # Validates the harness itself: transformers' own sampling fits the enumerated distribution.
    gen_kwargs = CONFIGS["temperature_0.6_top_k_3"]
    target = exact_joint(model, **gen_kwargs)
    torch.manual_seed(2)
    counts = sample_counts(model, lambda m, **kw: m.generate(PROMPT, max_new_tokens=L, do_sample=True, **kw),
                           **gen_kwargs)
    assert chi_square_pvalue(counts, target) > ALPHA


def _all_rows(draft, row_scores):
    rows = [row_scores(i) for i in range(draft.numel() + 1)]
    return torch.softmax(torch.cat(rows), dim=-1), rows


def _keep_every_draft(draft, row_scores, uniforms):
    probs, rows = _all_rows(draft, row_scores)
    n = draft.numel()
    return torch.cat([draft, sample_rows(probs[n:], uniforms[n: n + 1])]), rows


def _reject_without_removing(draft, row_scores, uniforms):
    """Keeps d_i with probability p(d_i), but redraws a rejected position from p itself."""
    probs, rows = _all_rows(draft, row_scores)
    n = draft.numel()
    n_kept = int((uniforms[:n] < probs[torch.arange(n), draft].double()).long().cumprod(0).sum())
    redraw = sample_rows(probs[n_kept:n_kept + 1], (uniforms[n_kept:n_kept + 1] * 7919.0) % 1.0)
    return torch.cat([draft[:n_kept], redraw]), rows


@pytest.mark.parametrize("wrong_rule", [_keep_every_draft, _reject_without_removing])
def test_negative_controls_are_rejected(model, wrong_rule):
    gen_kwargs = CONFIGS["temperature_1"]
    target = exact_joint(model, **gen_kwargs)
    # Chains: every step then goes through the wrong chain rule (a tree step is decided by the tree rule, whose own
    # negative control is in test_tree.py).
    sampler = lookup_sampler(DecodeStats(), torch.Generator().manual_seed(1), Rules(row_by_row=wrong_rule),
                             tree_width=1)
    counts = sample_counts(model, sampler, **gen_kwargs)
    assert chi_square_pvalue(counts, target) < ALPHA


def test_seeded_generator_reproduces_output(model):
    outs = [model.generate(PROMPT, max_new_tokens=12, do_sample=True, custom_generate=lookup_decode.generate,
                           generator=torch.Generator().manual_seed(seed), min_match=1) for seed in (5, 5, 6)]
    assert outs[0].tolist() == outs[1].tolist()
    assert outs[0].tolist() != outs[2].tolist()


@pytest.mark.parametrize("gen_kwargs", [CONFIGS["temperature_1"], CONFIGS["top_p_0.7"]])
def test_same_seed_same_tokens_with_or_without_drafts(model, gen_kwargs):
    # Per-position uniforms make the sampled tokens independent of how many drafts each step verified,
    # so the seed alone fixes the output (the adaptive policy's timing-driven choices cannot change it).
    for seed in range(5):
        outs = []
        for k in (0, 2, 8):
            stats = DecodeStats()
            outs.append(model.generate(PROMPT, max_new_tokens=20, do_sample=True,
                                       custom_generate=lookup_decode.generate,
                                       generator=torch.Generator().manual_seed(seed), min_match=1, k=k,
                                       adaptive=False, stats=stats, **gen_kwargs).tolist())
        assert outs[0] == outs[1] == outs[2]
    assert stats.accepted > 0
