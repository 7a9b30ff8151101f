"""generate(memory=..., references=...) gives plain generate's tokens, and drafts from memory really are kept."""

import threading

import numpy as np
import pytest
import torch
from conftest import VOCAB, FlatCosts, chat_ids, lookup_generate, repetitive_prompt

import lookup_decode
from lookup_decode import DecodeStats, Memory, References

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


def accepted_from(corpus) -> int:
    return sum(e.accepted for e in corpus.entries())


def random_prompt(seed, length=20):
    rng = np.random.default_rng(seed)
    return torch.tensor(rng.integers(3, VOCAB, length), dtype=torch.long)[None]


@pytest.mark.parametrize("adaptive", [False, True])
def test_memory_equals_plain_greedy_and_is_used(tiny_lm, adaptive):
    memory = Memory(max_tokens=10_000)
    prompts = [random_prompt(s) for s in range(3)]
    for rounds in range(2):                     # the second round re-asks what the first produced
        for prompt in prompts:
            ref = tiny_lm.generate(prompt, max_new_tokens=40, **GREEDY)
            # adaptive: priced flat (conftest.FlatCosts), so no draft from memory is priced out by the load
            got = lookup_generate(tiny_lm, prompt, max_new_tokens=40, **GREEDY, memory=memory, adaptive=adaptive,
                                  costs=FlatCosts() if adaptive else None)
            assert got.tolist() == ref.tolist()
    assert len(memory) == 3                    # one entry per distinct output
    assert accepted_from(memory) > 0           # guard: drafts from memory were verified and kept


def test_memory_through_direct_call_and_bound_hook(tiny_llama):
    memory = Memory(max_tokens=10_000)
    prompt = random_prompt(7)
    ref = tiny_llama.generate(prompt, max_new_tokens=48, **GREEDY)
    first = lookup_decode.generate(tiny_llama, prompt, max_new_tokens=48, memory=memory, adaptive=False, **GREEDY)
    stats = DecodeStats()
    hook = lookup_decode.lookup_decoding(memory=memory, adaptive=False, stats=stats)
    second = tiny_llama.generate(prompt, max_new_tokens=48, custom_generate=hook, **GREEDY)
    assert first.tolist() == second.tolist() == ref.tolist()
    # the second request copies its whole answer from memory: many tokens per step
    assert accepted_from(memory) >= 40 and stats.mean_accepted_length > 5


def test_references_equal_plain_greedy_and_are_used(tiny_lm):
    prompt = random_prompt(3)
    ref = tiny_lm.generate(prompt, max_new_tokens=40, **GREEDY)
    refs = References()
    refs.register("earlier answer", tokens=ref[0, prompt.shape[1]:])
    refs.register("noise", tokens=np.random.default_rng(0).integers(3, VOCAB, 500))
    got = tiny_lm.generate(prompt, max_new_tokens=40, **GREEDY, custom_generate=lookup_decode.generate,
                           references=refs, adaptive=False)
    assert got.tolist() == ref.tolist()
    assert accepted_from(refs) > 0
    assert len(refs) == 2                      # references do not learn from requests


def test_memory_and_references_with_repetitive_prompts(tiny_lm):
    memory, refs = Memory(max_tokens=2_000), References()
    refs.register("r", tokens=repetitive_prompt(1)[0])
    stats = DecodeStats()
    for seed in range(4):
        prompt = repetitive_prompt(seed)
        ref = tiny_lm.generate(prompt, max_new_tokens=32, **GREEDY)
        # the adaptive path, priced flat: no draft is priced out by the load
        got = lookup_generate(tiny_lm, prompt, max_new_tokens=32, memory=memory, references=refs, k=8, stats=stats,
                              costs=FlatCosts(), **GREEDY)
        assert got.tolist() == ref.tolist()
    assert stats.accepted > 0                  # guard: drafts were verified and kept


def test_sampling_with_memory_draws_the_same_sample(tiny_llama):
    # Sampling draws one uniform per output position up front, so a seed gives the same sample
    # whatever was drafted: memory must not change it (test_sampling.py proves that sample exact).
    prompt = random_prompt(11)
    memory = Memory(max_tokens=10_000)
    kw = dict(max_new_tokens=40, do_sample=True, temperature=0.7, top_p=0.95, pad_token_id=0, eos_token_id=None)
    without = lookup_decode.generate(tiny_llama, prompt, generator=torch.Generator().manual_seed(5), **kw)
    memory.add(without[0, prompt.shape[1]:])
    with_memory = lookup_decode.generate(tiny_llama, prompt, generator=torch.Generator().manual_seed(5),
                                         memory=memory, adaptive=False, **kw)
    assert with_memory.tolist() == without.tolist()
    assert accepted_from(memory) > 0


def test_threads_share_one_memory(tiny_llama):
    memory = Memory(max_tokens=100_000)
    prompts = [random_prompt(20 + i) for i in range(6)]
    refs = [tiny_llama.generate(p, max_new_tokens=24, **GREEDY) for p in prompts]
    results, errors = {}, []

    def work(t):
        try:
            for i in range(t, len(prompts), 3):
                results[i] = lookup_decode.generate(tiny_llama, prompts[i], max_new_tokens=24, memory=memory,
                                                    adaptive=False, **GREEDY)
        except Exception as e:                  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
    [th.start() for th in threads]
    [th.join() for th in threads]
    assert not errors
    assert all(results[i].tolist() == refs[i].tolist() for i in range(len(prompts)))
    assert len(memory) == len({tuple(r[0, 20:].tolist()) for r in refs})


def test_unknown_token_ids_for_the_model_are_refused(tiny_llama):
    memory = Memory(max_tokens=100)
    memory.add([5, VOCAB + 3])                 # filled with another tokenizer
    with pytest.raises(ValueError, match=f"token id {VOCAB + 3} .* vocabulary of {VOCAB}"):
        lookup_decode.generate(tiny_llama, random_prompt(0), max_new_tokens=4, memory=memory, **GREEDY)
    refs = References()
    refs.register("doc", tokens=[VOCAB])
    with pytest.raises(ValueError, match="references holds token id"):
        lookup_decode.generate(tiny_llama, random_prompt(0), max_new_tokens=4, references=refs, **GREEDY)


def test_wrong_kinds_are_refused(tiny_llama):
    with pytest.raises(TypeError, match="memory= takes a lookup_decode.Memory"):
        lookup_decode.generate(tiny_llama, random_prompt(0), max_new_tokens=4, memory={"x": 1}, **GREEDY)
    with pytest.raises(TypeError, match="references= takes"):
        lookup_decode.generate(tiny_llama, random_prompt(0), max_new_tokens=4, references=Memory(10), **GREEDY)
    with pytest.raises(ValueError, match="not both"):
        lookup_decode.generate(tiny_llama, random_prompt(0), max_new_tokens=4, memory=Memory(10),
                               proposer=lookup_decode.SuffixIndex(), **GREEDY)


@pytest.mark.real_model
def test_real_model_second_request_copies_from_memory(real_model):
    """A first chat, then a fresh chat re-asking the same question and a second turn re-asking for the
    earlier answer (MT-Redundant): identical to plain generate; the fresh chat's answer comes from memory."""
    from test_real_model import REQUESTS  # copied into tests/data: no ../shared/data needed
    model, tokenizer = real_model
    req = next(r for r in REQUESTS if r.category == "mt_redundant")
    memory = Memory(max_tokens=50_000)
    first = chat_ids(tokenizer, req.messages[0]["content"])
    a1 = lookup_decode.generate(model, first, max_new_tokens=40, do_sample=False, memory=memory)
    assert a1.tolist() == model.generate(first, max_new_tokens=40, do_sample=False).tolist()

    stats = DecodeStats()
    # Fixed draft lengths: the adaptive policy's choices depend on measured timings (a busy machine drafts less).
    again = model.generate(first, max_new_tokens=40, do_sample=False, custom_generate=lookup_decode.generate,
                           memory=memory, stats=stats, adaptive=False, k=16)
    assert again.tolist() == a1.tolist()
    assert accepted_from(memory) > 0 and stats.mean_accepted_length > 3

    answer = tokenizer.decode(a1[0, first.shape[1]:], skip_special_tokens=True)
    second = tokenizer.apply_chat_template(
        [req.messages[0], {"role": "assistant", "content": answer}, req.messages[2]],
        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    ref = model.generate(second, max_new_tokens=40, do_sample=False)
    got = model.generate(second, max_new_tokens=40, do_sample=False, custom_generate=lookup_decode.generate,
                         memory=memory)
    assert got.tolist() == ref.tolist()


class CharTokenizer:
    """Stub chat tokenizer for the tiny models: one id per character (mod the vocabulary)."""

    def apply_chat_template(self, messages, add_generation_prompt=True, return_tensors="pt", return_dict=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        return {"input_ids": torch.tensor([[3 + ord(c) % (VOCAB - 3) for c in text]])}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x100 + int(i)) for i in ids)


def test_chat_loop_keeps_one_memory_across_turns(tiny_llama, tmp_path):
    import io

    from lookup_decode.cli.chat import chat_loop
    memory = Memory(max_tokens=10_000)
    lines = ["tell me a story", "tell me a story", "/reset", "tell me a story", "/exit", "never read"]
    err = io.StringIO()
    messages = chat_loop(tiny_llama, CharTokenizer(), lines, memory, max_new_tokens=16, out=io.StringIO(), err=err,
                         pad_token_id=0, eos_token_id=None,
                         adaptive=False)   # whole drafts: the cost model's choice depends on the load
    assert [m["role"] for m in messages] == ["user", "assistant"]      # /reset started a new conversation
    assert len(memory) >= 1 and err.getvalue().count("mean accepted length") == 3
    assert accepted_from(memory) > 0          # the repeated first turn after /reset drafted from memory


def test_a_prediction_equals_plain_greedy_and_drafts_the_output(tiny_llama):
    """OpenAI's Predicted Outputs in generate(): the output it predicts is drafted whole, through the hook too."""
    prompt = random_prompt(11)
    ref = tiny_llama.generate(prompt, max_new_tokens=48, **GREEDY)
    stats = DecodeStats()
    got = tiny_llama.generate(prompt, max_new_tokens=48, custom_generate=lookup_decode.generate, adaptive=False,
                              prediction=ref[0, prompt.shape[1]:], stats=stats, **GREEDY)
    assert got.tolist() == ref.tolist()
    assert stats.accepted >= 40 and stats.mean_accepted_length > 5       # guard: the prediction was drafted


def test_a_text_prediction_needs_the_tokenizer(tiny_llama):
    class Tokenizer:                                    # one id per character: "ABC" -> [3, 4, 5]
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [ord(c) - ord("A") + 3 for c in text]}

    prompt = random_prompt(12)
    ref = tiny_llama.generate(prompt, max_new_tokens=32, **GREEDY)
    text = "".join(chr(int(t) - 3 + ord("A")) for t in ref[0, prompt.shape[1]:])
    stats = DecodeStats()
    got = lookup_decode.generate(tiny_llama, prompt, max_new_tokens=32, prediction=text, tokenizer=Tokenizer(),
                                 adaptive=False, stats=stats, **GREEDY)
    assert got.tolist() == ref.tolist() and stats.accepted >= 25
    with pytest.raises(ValueError, match="text prediction needs the model's tokenizer"):
        lookup_decode.generate(tiny_llama, prompt, max_new_tokens=4, prediction=text, **GREEDY)


def test_a_batch_takes_one_prediction_per_row(tiny_llama):
    prompts = torch.cat([random_prompt(s) for s in (13, 14, 15)])
    ref = tiny_llama.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=40, **GREEDY)
    new = ref[:, prompts.shape[1]:]
    stats = DecodeStats()
    got = lookup_decode.generate(tiny_llama, prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=40,
                                 prediction=[new[0].tolist(), None, new[2]], adaptive=False, stats=stats, **GREEDY)
    assert got.tolist() == ref.tolist()
    steps = stats.row_steps
    assert steps[0] * 3 < steps[1] and steps[2] * 3 < steps[1]           # the predicted rows took far fewer steps
    with pytest.raises(ValueError, match="a batch of 3 rows needs one prediction per row"):
        lookup_decode.generate(tiny_llama, prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=4,
                               prediction=new[0].tolist(), **GREEDY)


def test_a_prediction_leads_over_the_prompts_copy(tiny_llama):
    """Fast apply: the prompt holds a text the output then differs from (the file before the edit), and the
    prediction is the output. The prediction's drafts lead: accepted lengths near k, the same output as plain. (With
    max_match=8 the prompt's copy ties with the prediction after 8 tokens: without the lead it would win the tie and
    break at each difference: 3.6 tokens a step here.)"""
    base = random_prompt(16)
    out = tiny_llama.generate(base, max_new_tokens=120, **GREEDY)[0, base.shape[1]:]
    edited = out.clone()
    edited[::12] = (edited[::12] + 1) % tiny_llama.config.vocab_size   # the prompt's copy differs every 12 tokens
    prompt = torch.cat([base, edited[None, :], base[:, :4]], dim=1)
    mask = torch.ones_like(prompt)
    ref = tiny_llama.generate(prompt, attention_mask=mask, max_new_tokens=120, **GREEDY)
    stats = DecodeStats()
    got = lookup_decode.generate(tiny_llama, prompt, attention_mask=mask, max_new_tokens=120,
                                 prediction=ref[0, prompt.shape[1]:], k=8, max_match=8, adaptive=False, stats=stats,
                                 **GREEDY)
    assert got.tolist() == ref.tolist()
    assert stats.accepted > 0 and stats.mean_accepted_length >= 0.8 * (8 + 1), stats.summary()
