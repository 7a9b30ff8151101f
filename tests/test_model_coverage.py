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
from transformers.cache_utils import DynamicCache

from lookup_decode import DecodeStats, UnsupportedCacheError
from lookup_decode.engines.hf.cache import RECORDS_RECURRENT

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
    """Before transformers 5.25 a recurrent state cannot be rolled back; a model with no attention layer at all
    (Mamba) is refused on every version."""
    if name == "jamba" and RECORDS_RECURRENT:
        pytest.skip("transformers >= 5.25 records Jamba's recurrent states: test_recurrent_state_rolled_back")
    model = tiny_models.build(name)
    cls = type(model).__name__
    with pytest.raises(UnsupportedCacheError, match=f"{cls} with DynamicCache: layer cache {layer}"):
        lookup(model, repetitive_prompt(0, length=16), DecodeStats(), n_new=8)


@pytest.mark.skipif(not RECORDS_RECURRENT, reason="transformers < 5.25 records no recurrent states")
@pytest.mark.parametrize("options", [dict(k=8, adaptive=False), dict(costs=FlatCosts())], ids=["k8", "defaults"])
@pytest.mark.parametrize("seed", [0, 1])
def test_recurrent_state_rolled_back(seed, options):
    """Jamba (Mamba layers beside attention): every rejected draft puts the recurrent state back exactly."""
    _, stats = check_family("jamba", repetitive_prompt(seed, length=16), n_new=48, **options)
    assert stats.accepted < stats.drafted       # some drafts were rejected: rollbacks were exercised


@pytest.mark.skipif(not RECORDS_RECURRENT, reason="transformers < 5.25 records no recurrent states")
def test_a_forward_that_records_no_states_is_refused(monkeypatch):
    """A model whose forward ignores the recording (Zamba's in 5.25) would be put back to a wrong state: refused."""
    model = tiny_models.build("jamba")
    monkeypatch.setattr(DynamicCache, "get_recurrent_states_to_keep", lambda self, layer_idx=None: 0)
    with pytest.raises(UnsupportedCacheError, match="did not record the recurrent states"):
        lookup(model, repetitive_prompt(0, length=16), DecodeStats(), n_new=8, k=8, adaptive=False)
