"""Shared fixtures and helpers: tiny random-weight models (from tests/tiny_models.py, the one factory), the real
default model (once per session), prompts, and lookup decoding priced flat (`FlatCosts`, `lookup_generate`)."""

import dataclasses
import inspect

import numpy as np
import pytest
import torch
from tiny_models import CORE, VOCAB, build

import lookup_decode
from lookup_decode.core.cost import CostCurve, CostModel


@pytest.fixture(autouse=True)
def _cost_cache(tmp_path, monkeypatch):
    """Measured cost curves persist on disk (cost.DiskCache): each test gets its own empty folder."""
    monkeypatch.setenv("LOOKUP_DECODE_COST_CACHE", str(tmp_path / "cost_cache"))


@pytest.fixture(autouse=True)
def _threads(request):
    """One torch thread for tiny models (threading overhead dwarfs their work and another process on
    the other core makes OpenMP spin); two for the real model."""
    torch.set_num_threads(2 if "real_model" in request.fixturenames else 1)


@pytest.fixture(scope="session", params=CORE)
def tiny_lm(request):
    return build(request.param)


@pytest.fixture(scope="session")
def tiny_llama():
    return build("llama")


def repetitive_prompt(seed: int, length: int = 24, repeats: int = 3) -> torch.Tensor:
    """[1, length * repeats + 4] prompt that repeats a random span, so copying is likely to pay."""
    rng = np.random.default_rng(seed)
    span = rng.integers(3, VOCAB, size=length)
    tail = rng.integers(3, VOCAB, size=4)
    return torch.tensor(np.concatenate([np.tile(span, repeats), tail]), dtype=torch.long)[None]


@pytest.fixture(scope="session")
def real_model():
    """(model, tokenizer) of the default SmolLM2-135M-Instruct, loaded once (about 30 s)."""
    return lookup_decode.load_model()


def chat_ids(tokenizer, text: str) -> torch.Tensor:
    from lookup_decode.engines.hf.models import chat_ids as template_ids
    return template_ids(tokenizer, [{"role": "user", "content": text}])


# ------------------------------------------------------------------ the adaptive path, priced flat

class FlatCurve(CostCurve):
    """Every width costs the same, whatever forwards are then observed (a real curve learns from each step)."""

    def __init__(self, max_w: int, rows: int = 1):
        super().__init__([1], [1.0], max_w, rows=rows)

    def observe(self, rows: int, w: int, seconds: float) -> None:
        pass


class FlatCosts(CostModel):
    """A cost model for exactness tests on the adaptive path: it calibrates as `CostModel` does (the timing
    forwards run and are rolled back), then prices every width the same and keeps it so. The policy still
    chooses each draft length from what it learns of acceptance, but no draft is priced out by this machine's
    load (a busy CI box timed one that way and verified nothing), so the test can assert that drafts were kept."""

    def curve(self, model, max_w, seconds_of, **kw) -> CostCurve:
        measured = super().curve(model, max_w, seconds_of, **kw)
        return FlatCurve(measured.max_w, measured.rows)


# What lookup_decode.lookup_decoding binds: its own keywords (stats, proposer, memory, ...) and LookupConfig's.
_HOOK_OPTIONS = ({*inspect.signature(lookup_decode.lookup_decoding).parameters} - {"config", "options", "costs"}) | {
    f.name for f in dataclasses.fields(lookup_decode.LookupConfig)}


def lookup_generate(model, inputs, *, costs: CostModel | None = None, **kw):
    """model.generate(inputs, **kw) with lookup decoding; kw mixes lookup options (k, min_match, adaptive, stats,
    proposer, memory, ...) with generate()'s own, as `custom_generate=lookup_decode.generate` takes them.

    costs (a CostModel, e.g. FlatCosts()): bind the lookup options to `lookup_decode.lookup_decoding(costs=...)`
    instead, the hook that takes a cost model; generate() gets the rest.
    """
    if costs is None:
        return model.generate(inputs, custom_generate=lookup_decode.generate, **kw)
    options = {name: kw.pop(name) for name in _HOOK_OPTIONS & kw.keys()}
    return model.generate(inputs, custom_generate=lookup_decode.lookup_decoding(costs=costs, **options), **kw)
