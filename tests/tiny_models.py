"""The one factory of tiny random-weight models for tests (CPU, float32, a few ms per forward).

`build(name, seed=0, dtype, device, **overrides)` returns the model of family `name` in eval mode, its
weights drawn after `torch.manual_seed(seed)`; `config(name, **overrides)` is its config alone. Overrides
replace config fields, for a test that needs an odd size: `build("gpt2", n_positions=64)` (a short
context), `build("llama", vocab_size=6, ...)` (a vocabulary small enough to enumerate). Sizes: vocabulary
96, hidden 32, 2 layers, init 0.1 (a larger init spreads the logits of a random model apart, so greedy
choices are rarely near-ties that a different matmul shape could flip). CORE are the three families the
`tiny_lm` fixture (conftest.py) runs a test over; `bart_copier()` is a BART trained to copy its input.
Used by every test, and by scripts/compat_table.py.
"""

from __future__ import annotations

import torch
import transformers as tf

VOCAB = 96
WINDOW = 24            # sliding window of the windowed families; prompts in the tests are longer
CORE = ("gpt2", "llama", "qwen2")
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
# The Llama-style fields most decoder-only configs share.
_BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1, **_IDS)


def _std(config_cls: str, model_cls: str, **extra):
    """(config class, model class, fields): the shared Llama-style fields, with some added or replaced."""
    return config_cls, model_cls, {**_BASE, **extra}


def _own(config_cls: str, model_cls: str, **fields):
    """(config class, model class, fields): a family with field names of its own (and the usual token ids)."""
    return config_cls, model_cls, {**fields, **_IDS}


# family name -> (config class, model class, config fields); the comment says which cache path it exercises
# (see lookup_decode/cache.py).
DECODER_ONLY = {
    "llama": _std("LlamaConfig", "LlamaForCausalLM"),
    "mistral": _std("MistralConfig", "MistralForCausalLM", sliding_window=None),
    "mixtral": _std("MixtralConfig", "MixtralForCausalLM", sliding_window=None, num_local_experts=4,
                    num_experts_per_tok=2),
    "qwen2": _std("Qwen2Config", "Qwen2ForCausalLM", use_sliding_window=False),
    "qwen3": _std("Qwen3Config", "Qwen3ForCausalLM", head_dim=8),
    "qwen3_moe": _std("Qwen3MoeConfig", "Qwen3MoeForCausalLM", head_dim=8, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32),
    "phi": _std("PhiConfig", "PhiForCausalLM"),
    "phi3": _std("Phi3Config", "Phi3ForCausalLM"),
    "gemma": _std("GemmaConfig", "GemmaForCausalLM", head_dim=8),
    "cohere": _std("CohereConfig", "CohereForCausalLM"),
    "stablelm": _std("StableLmConfig", "StableLmForCausalLM"),
    "olmo2": _std("Olmo2Config", "Olmo2ForCausalLM"),
    "granite": _std("GraniteConfig", "GraniteForCausalLM"),
    "starcoder2": _std("Starcoder2Config", "Starcoder2ForCausalLM", sliding_window=None),
    "smollm3": _std("SmolLM3Config", "SmolLM3ForCausalLM", num_hidden_layers=4),   # every 4th layer without RoPE
    "gpt2": _own("GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=1024,
                 initializer_range=0.1),
    "gpt_bigcode": _own("GPTBigCodeConfig", "GPTBigCodeForCausalLM", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                        n_positions=1024, initializer_range=0.1),
    "gptj": _own("GPTJConfig", "GPTJForCausalLM", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                 n_positions=1024, initializer_range=0.1),
    "gpt_neox": _own("GPTNeoXConfig", "GPTNeoXForCausalLM", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=1024, initializer_range=0.1),
    "opt": _own("OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=1024, word_embed_proj_dim=32, init_std=0.1),
    "falcon": _own("FalconConfig", "FalconForCausalLM", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                   num_attention_heads=4, initializer_range=0.1),
    "bloom": _own("BloomConfig", "BloomForCausalLM", vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4,
                  initializer_range=0.1),
}

# Sliding-window and hybrid caches (DynamicSlidingWindowLayer, conv layers): rolled back through
# transformers' past recording.
WINDOWED = {
    "mistral_sliding_window": _std("MistralConfig", "MistralForCausalLM", sliding_window=WINDOW),
    "qwen2_sliding_window": _std("Qwen2Config", "Qwen2ForCausalLM", use_sliding_window=True, sliding_window=WINDOW,
                                 max_window_layers=0),
    "gemma2": _std("Gemma2Config", "Gemma2ForCausalLM", head_dim=8, sliding_window=WINDOW),
    "gemma3": _std("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8, sliding_window=WINDOW,
                   layer_types=["sliding_attention", "full_attention"]),
    "cohere2": _std("Cohere2Config", "Cohere2ForCausalLM", sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"]),
    "lfm2": _std("Lfm2Config", "Lfm2ForCausalLM", layer_types=["conv", "full_attention"]),
}

# Recurrent state that cannot roll back: must be refused with an error naming model and layer.
RECURRENT = {
    "mamba": _own("MambaConfig", "MambaForCausalLM", vocab_size=VOCAB, hidden_size=32, state_size=4,
                  num_hidden_layers=2, initializer_range=0.1),
    "jamba": _std("JambaConfig", "JambaForCausalLM", attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  num_experts=2, mamba_d_state=4, mamba_dt_rank=4),
}

# Encoder-decoder: the decoder verifies, drafts also copy the encoder's input (lookup_decode/encdec.py).
_SEQ2SEQ = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=1024,
                init_std=0.1, pad_token_id=0, eos_token_id=2, decoder_start_token_id=2)
ENCODER_DECODER = {
    "bart": ("BartConfig", "BartForConditionalGeneration", {**_SEQ2SEQ, "bos_token_id": 1, "forced_eos_token_id": 2}),
    "pegasus": ("PegasusConfig", "PegasusForConditionalGeneration", _SEQ2SEQ),
    "marian": ("MarianConfig", "MarianMTModel", _SEQ2SEQ),
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0)),
}

ALL = {**DECODER_ONLY, **WINDOWED, **RECURRENT, **ENCODER_DECODER}


def config(name: str, **overrides):
    """The config of family `name` (a key of ALL), with `overrides` replacing its fields."""
    config_cls, _, fields = ALL[name]
    return getattr(tf, config_cls)(**{**fields, **overrides})


def build(name: str, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu", **overrides):
    """The tiny model of family `name` in eval mode, weights drawn after torch.manual_seed(seed); `overrides`
    replace config fields (e.g. build("gpt2", n_positions=64)). The same arguments give the same weights."""
    torch.manual_seed(seed)
    return getattr(tf, ALL[name][1])(config(name, **overrides)).to(device=device, dtype=dtype).eval()


def bart_copier(steps: int = 150, seed: int = 0):
    """A 1-layer BART trained for a few seconds to copy its input: a stand-in for a summarizer that quotes.

    Random weights never copy the source, so only a trained model shows drafts from the encoder input
    being accepted. Trained on random 24-token sequences (CPU, 1 thread, about 5 s); deterministic.
    """
    model = build("bart", seed, encoder_layers=1, decoder_layers=1, init_std=0.05, dropout=0.0,
                  max_position_embeddings=256, bos_token_id=0).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        src = torch.randint(3, VOCAB, (32, 24), generator=gen)
        loss = model(input_ids=src, labels=src).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()
