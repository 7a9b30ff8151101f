"""Static cache (`cache_implementation="static"`) and a torch.compile'd forward.

Rollback on a static cache steps the write position back (StaticLayer.crop), so rejected slots are
masked and overwritten. With a compileable cache every verify forward has a size in policy.BUCKETS,
so a compiled forward compiles once per bucket instead of once per draft length.
"""

import functools

import numpy as np
import pytest
import tiny_models
import torch
from conftest import FlatCosts, lookup_generate, repetitive_prompt
from test_model_coverage import assert_same_greedy
from transformers import StaticCache

import lookup_decode
from lookup_decode import DecodeStats, Draft, UnsupportedCacheError
from lookup_decode.core.policy import BUCKETS, DraftPolicy

STATIC = dict(do_sample=False, pad_token_id=0, eos_token_id=None, cache_implementation="static")


def plain(model, prompt, n_new=40):
    return model.generate(prompt, max_new_tokens=n_new, return_dict_in_generate=True, output_logits=True, **STATIC)


def lookup(model, prompt, stats, n_new=40, **kw):
    """Lookup decoding on a static cache; kw: lookup options and generate()'s, and costs= (conftest.lookup_generate)."""
    kw.setdefault("min_match", 1)
    return lookup_generate(model, prompt, max_new_tokens=n_new, stats=stats, **STATIC, **kw)


class ForwardSizes:
    """Wraps model.forward (instance attribute only) to record the number of input tokens per call."""

    def __init__(self, model):
        self.sizes: list[int] = []
        inner = model.forward

        @functools.wraps(inner)                         # keeps the signature lookup_decode inspects
        def forward(*args, **kwargs):
            ids = kwargs.get("input_ids", kwargs.get("decoder_input_ids"))
            if ids is not None:
                self.sizes.append(ids.shape[1])
            return inner(*args, **kwargs)
        model.forward = forward


# lfm2 (conv layers) on a static cache: refused since issue 16 (the fuzzer found other tokens than plain at
# max_cache_len >= 256; see tests/test_failure_paths.py::test_static_cache_with_conv_layers_is_refused).
STATIC_OK = sorted([*tiny_models.DECODER_ONLY, *tiny_models.ENCODER_DECODER])
STATIC_REFUSED = sorted(set(tiny_models.WINDOWED) - {"lfm2"})


@pytest.mark.parametrize("name", STATIC_OK)
def test_static_cache_equals_plain(name):
    model = tiny_models.build(name)
    source = repetitive_prompt(0, length=16)
    ref = plain(model, source)
    prompt_len = 1 if model.config.is_encoder_decoder else source.shape[1]
    # Fixed draft lengths for every family; the defaults (adaptive, timed at bucket sizes) for two, priced flat
    # after that calibration so that no draft is priced out by the load.
    for options in [dict(k=8, adaptive=False)] + ([dict(costs=FlatCosts())] if name in ("llama", "bart") else []):
        stats = DecodeStats()
        spy = ForwardSizes(model)
        got = lookup(model, source, stats, **options)
        del model.forward                                  # back to the class's forward
        assert_same_greedy(ref, got, prompt_len)
        assert stats.accepted > 0
        verify_sizes = spy.sizes[1:]                       # after the prefill
        assert set(verify_sizes) <= set(BUCKETS), verify_sizes


def test_static_cache_is_the_one_used():
    model = tiny_models.build("llama")
    out = model.generate(repetitive_prompt(0, length=16), max_new_tokens=24, return_dict_in_generate=True,
                         custom_generate=lookup_decode.generate, min_match=1, **STATIC)
    assert isinstance(out.cache, StaticCache)
    assert int(out.cache.get_seq_length()) == out.sequences.shape[1] - 1


def test_compiled_forward_compiles_once_per_bucket():
    """A compiled forward (dynamic=False: one graph per input shape) sees the prefill and a few buckets only.

    The counting backend runs the traced graph as is, so this checks shapes and graph breaks, not the
    speed of inductor code (too slow to compile on a CI CPU).
    """
    model = tiny_models.build("gpt2")
    prompt = repetitive_prompt(0, length=16)
    ref = plain(model, prompt)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=backend, dynamic=False)
    try:
        stats = DecodeStats()
        got = lookup(model, prompt, stats, k=8, adaptive=False)
    finally:
        del model.forward
        torch._dynamo.reset()
    assert_same_greedy(ref, got, prompt.shape[1])
    assert stats.accepted > 0
    assert stats.steps > 10                                # many steps, yet ...
    assert len(graphs) <= 1 + sum(b <= 9 for b in BUCKETS)  # ... prefill + one graph per bucket up to k + 1


@pytest.mark.parametrize("name", STATIC_REFUSED)
def test_static_sliding_window_refused(name):
    # A static sliding-window layer overwrites its ring buffer once past the window: rejected drafts
    # cannot be undone. The error names model and layer and points to the dynamic cache.
    model = tiny_models.build(name)
    with pytest.raises(UnsupportedCacheError, match=f"{type(model).__name__} with StaticCache: layer cache "
                                                    "StaticSlidingWindowLayer.*dynamic cache"):
        lookup(model, repetitive_prompt(0, length=16), DecodeStats(), n_new=40)


@pytest.mark.parametrize("full, n, limit, want", [
    ([5, 6, 7], 2, 31, [5, 6, 7]),          # 2 drafts -> forward of 3 -> bucket 4: the proposer's third token joins
    ([5], 1, 31, [5]),                      # forward of 2 is a bucket
    ([5, 6], 2, 31, [5, 6, 0]),             # rounded up with the filler
    ([5, 6, 7], 0, 31, []),                 # no draft: forward of 1
    ([5, 6, 7, 8, 9], 5, 5, [5, 6, 7]),     # bucket 8 would pass the limit: round down to 4
    (list(range(40)), 32, 32, list(range(31))),  # k=32: the largest bucket is 32 (31 drafts)
])
def test_bucketed_draft(full, n, limit, want):
    got = DraftPolicy(32).fit(Draft(np.array(full, dtype=np.int32)), n, limit, "buckets").tokens
    assert got.tolist() == want
    assert len(got) + 1 in BUCKETS
