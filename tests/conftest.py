"""Shared fixtures: tiny random-weight models (fast, CPU, float32) and the real default model (once per session)."""

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 96


@pytest.fixture(autouse=True)
def _cost_cache(tmp_path, monkeypatch):
    """Measured cost curves persist on disk (cost.DiskCache): each test gets its own empty folder."""
    monkeypatch.setenv("LOOKUP_DECODE_COST_CACHE", str(tmp_path / "cost_cache"))


@pytest.fixture(autouse=True)
def _threads(request):
    """One torch thread for tiny models (threading overhead dwarfs their work and another process on
    the other core makes OpenMP spin); two for the real model."""
    torch.set_num_threads(2 if "real_model" in request.fixturenames else 1)

# A larger init spreads the logits of a random model apart, so greedy choices are not near-ties
# that a different matmul shape (one token vs a verified block) could flip.
_INIT = 0.1


def _llama():
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=_INIT, pad_token_id=0,
        bos_token_id=1, eos_token_id=2))


def _gpt2():
    return GPT2LMHeadModel(GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=1024, initializer_range=_INIT,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _qwen2():
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=_INIT, use_sliding_window=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))


TINY_ARCHS = {"llama": _llama, "gpt2": _gpt2, "qwen2": _qwen2}


def make_tiny(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    return TINY_ARCHS[arch]().eval()


@pytest.fixture(scope="session", params=sorted(TINY_ARCHS))
def tiny_lm(request):
    return make_tiny(request.param)


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny("llama")


def repetitive_prompt(seed: int, length: int = 24, repeats: int = 3) -> torch.Tensor:
    """[1, length * repeats + 4] prompt that repeats a random span, so copying is likely to pay."""
    rng = np.random.default_rng(seed)
    span = rng.integers(3, VOCAB, size=length)
    tail = rng.integers(3, VOCAB, size=4)
    return torch.tensor(np.concatenate([np.tile(span, repeats), tail]), dtype=torch.long)[None]


@pytest.fixture(scope="session")
def real_model():
    """(model, tokenizer) of the default SmolLM2-135M-Instruct, loaded once (about 30 s)."""
    import lookup_decode
    return lookup_decode.load_model()


def chat_ids(tokenizer, text: str) -> torch.Tensor:
    from lookup_decode.engines.hf.models import chat_ids as template_ids
    return template_ids(tokenizer, [{"role": "user", "content": text}])
