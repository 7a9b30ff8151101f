"""Model coverage: every listed family and cache type gives plain generate's greedy tokens, or a clear error.

Exactness rule (transformers' own for comparing generations): the outputs are equal, or they differ
only after a position where plain decoding's top-2 logits were within `tol` (a near-tie that a
different matmul shape may flip). Every comparison also asserts drafts were accepted: fixed-k runs verify
every draft, and runs on the adaptive path are priced flat (conftest.FlatCosts), so none is priced out.
The results feed the README compatibility table (scripts/compat_table.py).
"""

import pytest
import tiny_models
import torch
from conftest import FlatCosts, lookup_generate, repetitive_prompt

from lookup_decode import DecodeStats, UnsupportedCacheError

N_NEW = 40


def plain(model, prompt, n_new=N_NEW, **kw):
    """Plain greedy generate with the logits it saw at every step (for the near-tie rule)."""
    return model.generate(prompt, do_sample=False, pad_token_id=0, eos_token_id=None, max_new_tokens=n_new,
                          return_dict_in_generate=True, output_logits=True, **kw)


def lookup(model, prompt, stats, n_new=N_NEW, **kw):
    """Lookup decoding, greedy; kw: lookup options and generate()'s, and costs= (see conftest.lookup_generate)."""
    kw.setdefault("min_match", 1)
    return lookup_generate(model, prompt, do_sample=False, pad_token_id=0, eos_token_id=None, max_new_tokens=n_new,
                           stats=stats, **kw)


def assert_same_greedy(ref, got: torch.Tensor, prompt_len: int, tol: float = 1e-5) -> None:
    """got == ref.sequences, or equal up to a first mismatch where plain decoding had a near-tie."""
    want = ref.sequences
    assert got.shape == want.shape
    diff = (got[0] != want[0]).nonzero()
    if diff.numel() == 0:
        return
    i = int(diff[0]) - prompt_len
    assert i >= 0, "the prompt itself changed"
    top2 = ref.logits[i][0].float().topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap <= tol, f"first mismatch at new token {i}: plain decoding's top-2 logits differ by {gap:.3g} > {tol}"


def check_family(name, prompt, n_new=N_NEW, tol=1e-5, dtype=torch.float32, **options):
    model = tiny_models.build(name, dtype=dtype)
    ref = plain(model, prompt, n_new)
    stats = DecodeStats()
    got = lookup(model, prompt, stats, n_new, **options)
    assert_same_greedy(ref, got, prompt.shape[1], tol)
    assert stats.accepted > 0                  # guard: drafts were verified and kept
    return model, stats


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(tiny_models.DECODER_ONLY))
def test_decoder_only(name, seed):
    check_family(name, repetitive_prompt(seed, length=16), k=8, adaptive=False)


@pytest.mark.parametrize("name", sorted(tiny_models.DECODER_ONLY))
def test_decoder_only_default_options(name):
    # Defaults: adaptive draft lengths, k=32; calibrated as usual, then priced flat (no draft priced out).
    check_family(name, repetitive_prompt(2, length=16), costs=FlatCosts())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", sorted(tiny_models.WINDOWED))
def test_sliding_window_and_hybrid(name, seed):
    # The prompt (52 tokens) and the output run past the window (24), so rollback must restore states
    # a windowed layer would otherwise have evicted during the verify forward.
    prompt = repetitive_prompt(seed, length=16)
    assert prompt.shape[1] > tiny_models.WINDOW
    check_family(name, prompt, n_new=48, k=8, adaptive=False)


@pytest.mark.parametrize("name", sorted(tiny_models.WINDOWED))
def test_windowed_cache_is_used_and_stays_bounded(name):
    """The test above really ran a windowed cache, and rollback leaves it at its window, not the context."""
    model = tiny_models.build(name)
    prompt = repetitive_prompt(0, length=16)
    stats = DecodeStats()
    out = lookup(model, prompt, stats, n_new=48, k=8, adaptive=False, return_dict_in_generate=True)
    cache = out.cache
    windowed = [layer for layer in cache.layers if type(layer).__name__ != "DynamicLayer"]
    assert windowed, f"{name}: expected sliding-window or conv layers, got {cache.layers}"
    for layer in windowed:
        if hasattr(layer, "sliding_window"):
            assert layer.keys.shape[-2] <= layer.sliding_window - 1
        else:                                    # conv layer: back to its kernel size
            assert all(s is None or s.shape[-1] <= layer.conv_kernel_size[i] for i, s in layer.conv_states.items())
    assert stats.accepted > 0


@pytest.mark.parametrize("name, layer", [("mamba", "LinearAttentionLayer"), ("jamba", "LinearAttentionLayer")])
def test_recurrent_state_refused(name, layer):
    model = tiny_models.build(name)
    cls = type(model).__name__
    with pytest.raises(UnsupportedCacheError, match=f"{cls} with DynamicCache: layer cache {layer}"):
        lookup(model, repetitive_prompt(0, length=16), DecodeStats(), n_new=8)
