"""transformers integration: `model.generate(..., custom_generate=lookup_decode.generate)`.

transformers prepares everything (generation config, logits processors, stopping criteria incl.
stop strings, the cache) and calls the custom_generate callable with the contract of its own
`_sample`; `generate` below checks what lookup decoding supports, runs `decode.decode`, and
returns what `_sample` would (a tensor, or a GenerateDecoderOnlyOutput). Called directly,
`lookup_decode.generate(model, input_ids, **generate_kwargs)` goes through `model.generate` the
same way, so both paths share transformers' own preparation. Every transformers-specific line of
the package is in `engines.hf`.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from transformers import StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

from lookup_decode.core.acceptance import new_counts
from lookup_decode.core.config import LookupConfig
from lookup_decode.core.cost import COSTS
from lookup_decode.core.decode import Recorded, Rows, decode
from lookup_decode.core.index import SuffixIndex
from lookup_decode.core.policy import DraftPolicy
from lookup_decode.core.stats import DecodeStats
from lookup_decode.core.tokens import eos_ids, trim_at_eos
from lookup_decode.core.verify import Rules
from lookup_decode.engines.hf import encdec
from lookup_decode.engines.hf.cache import check_batchable, check_croppable, crop, has_recurrent_state, new_cache
from lookup_decode.engines.hf.draft_model import DraftModelProposer
from lookup_decode.engines.hf.forward import BatchForward, SequenceForward, check_batch_memory, vocab_size
from lookup_decode.engines.hf.stopping import first_stops
from lookup_decode.sources.memory import prediction_of
from lookup_decode.sources.proposer import PREDICTION, check_sources, with_sources
from lookup_decode.sources.tree import TreeProposer

# The output's cache field: `cache` in transformers 5.x, `past_key_values` in 4.56-4.57.
_CACHE_FIELD = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


def _check_request(model, input_ids, generation_config, model_kwargs) -> None:
    """Clear errors for what lookup decoding cannot do (yet), before any forward runs."""
    name = type(model).__name__
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: lookup decoding needs at least one input token")
    for option in ("num_beams", "num_return_sequences"):
        if (getattr(generation_config, option, 1) or 1) > 1:
            raise ValueError(f"lookup_decode does not support {option} > 1 (got {getattr(generation_config, option)}); "
                             "use plain model.generate for beam search or several sequences")
    if generation_config.prompt_lookup_num_tokens is not None:
        raise ValueError("pass either custom_generate=lookup_decode.generate or prompt_lookup_num_tokens, not both")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError("lookup_decode does not return attentions or hidden states; drop output_attentions/"
                         "output_hidden_states (scores and logits are supported)")
    if generation_config.do_sample:
        t, top_p, top_k = generation_config.temperature, generation_config.top_p, generation_config.top_k
        if t is not None and not t > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {t} (use do_sample=False for greedy)")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_k is not None and top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
    if not encdec.is_encoder_decoder(model):  # else the mask is the encoder input's
        _check_attention_mask(model_kwargs.get("attention_mask"), input_ids)
    vocab = vocab_size(model)
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"input_ids hold token ids outside the model's vocabulary [0, {vocab}): min {low}, max {high}")
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None and input_ids.shape[1] >= context:
        raise ValueError(f"the prompt has {input_ids.shape[1]} tokens but {name} has a context of {context} tokens")


def _check_attention_mask(mask, input_ids) -> None:
    """The mask must match input_ids, hold only 0/1, and pad on the left (as generate() expects of decoders)."""
    if mask is None:
        return
    if tuple(mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)} "
                         f"but input_ids has shape {tuple(input_ids.shape)}")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    if bool((mask[:, -1] == 0).any()) or bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError("attention_mask pads on the right (or in the middle); decoder-only generation needs left "
                         "padding: tokenizer.padding_side = 'left'")


def _is_batched(model, input_ids, model_kwargs) -> bool:
    # An encoder-decoder's attention_mask belongs to its encoder input.
    mask = None if encdec.is_encoder_decoder(model) else model_kwargs.get("attention_mask")
    return input_ids.shape[0] > 1 or (mask is not None and not bool((mask == 1).all()))


def _pad_token_id(generation_config) -> int:
    pad = getattr(generation_config, "_pad_token_tensor", None)
    pad = pad if pad is not None else generation_config.pad_token_id
    if pad is None:
        eos = eos_ids(generation_config)
        if not eos:
            raise ValueError("batched generation needs a pad_token_id (or an eos_token_id) to pad finished rows")
        pad = eos[0]
    return int(pad.reshape(-1)[0]) if isinstance(pad, torch.Tensor) else int(pad)


def _check_streamer(streamer, input_ids) -> None:
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError(f"streamers take one sequence; got a batch of {input_ids.shape[0]} rows "
                         "(stream one request at a time)")


@dataclass
class _Call:
    """What one lookup-decoding call was given besides transformers' own arguments."""
    options: LookupConfig
    stats: DecodeStats | None = None
    proposer: object = None
    generator: torch.Generator | None = None
    sources: tuple = ()
    rules: Rules = Rules()
    costs: object = COSTS
    prediction: object = None      # per call (one row) or per row (a batch): text or token ids, None: none
    tokenizer: object = None       # reads a text prediction


def _drafters(model, call: _Call, generation_config, rows: int, trees: bool) -> list:
    """One drafter per row: the caller's proposer(s), else a SuffixIndex (with memory/references if given); a
    TreeProposer where the forward verifies trees (trees) and options.tree_width > 1."""
    proposer, options = call.proposer, call.options
    if proposer is not None and (call.sources or call.prediction is not None):
        raise ValueError("memory/references/prediction draft through lookup_decode's own index; pass them or a "
                         "proposer, not both")
    if proposer is not None:
        drafters = list(proposer) if isinstance(proposer, (list, tuple)) else [proposer]
        if len(drafters) != rows:
            raise ValueError(f"a batch of {rows} rows needs one proposer per row: pass proposer=[...] with {rows} "
                             "proposers")
        for d in drafters:
            if isinstance(d, DraftModelProposer):
                d.check_compatible(model)
        return drafters
    match = dict(min_match=options.min_match, max_match=options.max_match, eos_token_ids=eos_ids(generation_config))
    # Session memory / reference documents (memory.py, sources.py), and each row's own prediction.
    vocab = vocab_size(model)
    sources = [call.sources + (((PREDICTION, p),) if p is not None else ())
               for p in _predictions(call.prediction, rows, call.tokenizer, vocab)]
    index = partial(TreeProposer, width=options.tree_width) if trees and options.tree_width > 1 else SuffixIndex
    return [with_sources(index(**match), s, vocab, **match) if s else index(**match) for s in sources]


def _predictions(prediction, rows: int, tokenizer, vocab_size: int) -> list:
    """Each row's prediction as a corpus (None: none): for one row a text or token ids, for a batch one such entry
    (or None) per row."""
    if prediction is None:
        return [None] * rows
    ids = isinstance(prediction, (torch.Tensor, np.ndarray)) or (
        isinstance(prediction, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prediction))
    if rows == 1 and (ids or isinstance(prediction, str)):
        prediction = [prediction]
    if not isinstance(prediction, (list, tuple)) or len(prediction) != rows:
        raise ValueError(f"a batch of {rows} rows needs one prediction per row (a text, token ids or None): pass "
                         f"prediction=[...] with {rows} entries")
    return [None if p is None else prediction_of(p, tokenizer=tokenizer, vocab_size=vocab_size) for p in prediction]


# The acceptance model's pooled counts per model: every call on a model learns into and prices from one pool (a
# request alone is too short to learn from scratch). Concurrent calls may lose an update to a race, nothing worse.
_POOLS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def forget_acceptance(model) -> None:
    """Empty what the calls on `model` learned of acceptance: its next call prices drafts as a fresh process's
    first call does (a measurement's warm-up must not teach its timed call the answer's first tokens)."""
    _POOLS.pop(model, None)


def _policy(k: int, generation_config, model) -> DraftPolicy:
    """The draft policy of one call, over its model's acceptance pool: a sampled call's rows keep drafts at the
    target's odds, so the model prices them by their temperature (greedy: 0)."""
    t = float(getattr(generation_config, "temperature", None) or 1.0) if generation_config.do_sample else 0.0
    try:
        counts = _POOLS.setdefault(model, new_counts())
    except TypeError:                   # an object that takes no weak reference: a pool for this call
        counts = None
    return DraftPolicy(k, temperature=t, counts=counts)


def _batch_forward(model, input_ids, logits_processor, generation_config, streamer, call: _Call, cache, model_kwargs):
    """Batches (or a left-padded row): (BatchForward, pad token id, bool prompt mask [B, P]); ragged acceptance,
    see forward.BatchForward."""
    options = call.options
    _check_streamer(streamer, input_ids)
    check_batchable(cache, model)
    if generation_config.return_dict_in_generate and (generation_config.output_scores
                                                      or generation_config.output_logits):
        raise ValueError("output_scores/output_logits are not supported for batches yet; generate rows one by one")
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise ValueError(f"{type(model).__name__}.forward takes no position_ids; batched lookup decoding needs them")
    check_batch_memory(model, input_ids.shape[0], generation_config.max_length, options.k, options.hole_share,
                       options.min_holes)
    mask = model_kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask
    forward = BatchForward(model, cache, logits_processor, mask, do_sample=bool(generation_config.do_sample),
                           generator=call.generator, rules=call.rules, hole_share=options.hole_share,
                           min_holes=options.min_holes)
    return forward, _pad_token_id(generation_config), mask.to(torch.bool)


def _decoding_loop(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer, call: _Call,
                   model_kwargs, inputs_tensor=None):
    _check_request(model, input_ids, generation_config, model_kwargs)
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    cache = new_cache(model) if cache is None else cache
    check_croppable(cache, model)
    if cache.get_seq_length() != 0:
        raise ValueError("lookup_decode starts from an empty cache; a pre-filled cache was passed")
    do_sample, source, mask, pad, record = bool(generation_config.do_sample), None, None, 0, None
    if _is_batched(model, input_ids, model_kwargs):
        forward, pad, mask = _batch_forward(model, input_ids, logits_processor, generation_config, streamer, call,
                                            cache, model_kwargs)
    else:
        input_name, extra = "input_ids", None
        if encdec.is_encoder_decoder(model):     # the decoder verifies; drafts may copy the encoder's input
            source = encdec.source_ids(model, inputs_tensor, model_kwargs)
            input_name, extra = "decoder_input_ids", encdec.decoder_forward_kwargs(model, model_kwargs)
        forward = SequenceForward(model, cache, logits_processor, do_sample=do_sample, generator=call.generator,
                                  rules=call.rules, input_name=input_name, extra=extra)
        record = Recorded() if generation_config.return_dict_in_generate else None
    drafters = _drafters(model, call, generation_config, input_ids.shape[0], forward.draft_kind == "tree")
    if source is not None:
        drafters[0].extend(source[0])
    rows = Rows.start(input_ids, generation_config.max_length, pad_token_id=pad, do_sample=do_sample,
                      generator=call.generator)
    # transformers' stopping criteria as the step's stop rule: asked after every emitted token
    stops = partial(first_stops, stopping_criteria) if stopping_criteria else None
    try:
        sequences = decode(rows, forward, drafters, _policy(call.options.k, generation_config, model),
                           prompt_mask=mask, stops=stops, stats=call.stats, streamer=streamer, record=record,
                           adaptive=call.options.adaptive, costs=call.costs)
    finally:  # on every way out (an error, Ctrl-C): a TextIteratorStreamer's reader would otherwise wait forever
        if streamer is not None:
            streamer.end()
    P, eos = input_ids.shape[1], eos_ids(generation_config)
    for b in range(input_ids.shape[0] if call.sources else 0):  # the memory stores each row's output (to its EOS)
        for _, corpus in call.sources:
            corpus.remember(input_ids[b] if mask is None else input_ids[b][mask[b]], trim_at_eos(sequences[b, P:], eos))
    if not generation_config.return_dict_in_generate:
        return sequences
    if mask is not None:  # no cache: its columns hold holes and finished rows left it, so generate could not go on
        return GenerateDecoderOnlyOutput(sequences=sequences)
    crop_to = sequences.shape[1] - 1  # like plain decoding: the last token never entered the cache
    # A recurrent state (transformers >= 5.25) cannot go back past the last verify's rollback: such a cache keeps
    # the tokens a stop cut from the output.
    if int(cache.get_seq_length()) > crop_to and not has_recurrent_state(cache):
        crop(cache, int(cache.get_seq_length()) - crop_to)
    output_class = GenerateEncoderDecoderOutput if source is not None else GenerateDecoderOnlyOutput
    return output_class(sequences=sequences, scores=tuple(record.scores) if generation_config.output_scores else None,
                        logits=tuple(record.logits) if generation_config.output_logits else None,
                        **{_CACHE_FIELD: cache})


def lookup_decoding(config: LookupConfig | None = None, *, stats: DecodeStats | None = None, proposer=None,
                    generator: torch.Generator | None = None, streamer=None, memory=None, references=None,
                    prediction=None, tokenizer=None, costs=COSTS, rules: Rules = Rules(), **options):
    """Return a callable for `model.generate(custom_generate=...)` with options bound.

    Useful when options must not travel through generate()'s kwargs, and to pass a streamer:
    transformers (5.x) does not hand `generate(streamer=...)` to a callable custom_generate, so
    bind it here (it receives the prompt first, then the generated tokens, like plain generate).
    costs: the `CostModel` that keeps this model's measured forward costs (default: the shared
    `lookup_decode.COSTS`). rules: the acceptance rules (`verify.Rules`); tests swap in a wrong one to
    show that they catch it. prediction, tokenizer: as for `generate`.
    """
    config = config if config is not None else LookupConfig(**options)
    bound_streamer = streamer
    call = _Call(config, stats, proposer, generator, tuple(check_sources(memory, references)), rules, costs,
                 prediction, tokenizer)

    def decoding_loop(model, input_ids, logits_processor, stopping_criteria, generation_config,
                      synced_gpus=False, streamer=None, inputs_tensor=None, **model_kwargs):
        if synced_gpus:
            raise ValueError("lookup_decode does not support synced_gpus (DeepSpeed ZeRO-3 / FSDP generation)")
        if streamer is None and bound_streamer is not None:
            # transformers put the prompt only into a streamer it was given; this one it never saw.
            streamer = bound_streamer
            _check_streamer(streamer, input_ids)
            streamer.put(input_ids.cpu())
        return _decoding_loop(model, input_ids, logits_processor, stopping_criteria, generation_config,
                              streamer, call, model_kwargs, inputs_tensor=inputs_tensor)

    return decoding_loop


def generate(model, input_ids=None, logits_processor=None, stopping_criteria=None, generation_config=None,
             synced_gpus=False, streamer=None, tokenizer=None, *, k: int | None = None, min_match: int | None = None,
             max_match: int | None = None, adaptive: bool | None = None, tree_width: int | None = None,
             stats: DecodeStats | None = None, proposer=None, generator: torch.Generator | None = None, memory=None,
             references=None, prediction=None, inputs_tensor=None, **model_kwargs):
    """Lookup decoding with transformers' generate() contract.

    As a hook: `model.generate(**inputs, custom_generate=lookup_decode.generate, k=16, stats=s)`.
    Directly: `lookup_decode.generate(model, input_ids, max_new_tokens=200, streamer=..., k=16)`;
    any other keyword goes to `model.generate` as usual.

    Stop strings: transformers 5.x cannot combine `stop_strings` with a callable custom_generate
    (it drops the tokenizer), so pass them to this direct call: `stop_strings=[...], tokenizer=tok`.

    Options: k (most draft tokens per step, default 32), min_match (1), max_match (64), adaptive
    (True: draft lengths from measured cost and acceptance), tree_width (4: most branches of a tree draft where
    one row's forward verifies trees and the cost curve makes the extra nodes free; 1: chains), stats (a
    DecodeStats filled in place), proposer (a `Drafter`: extend(tokens) and propose(max_tokens) -> Draft; one
    per row for a batch; default a SuffixIndex over the prompt and output), generator (torch.Generator for sampling),
    memory (a lookup_decode.Memory: drafts also from earlier outputs, and stores this one), references
    (lookup_decode.References: drafts also from registered documents), prediction (the text the output is
    expected to repeat, as OpenAI's Predicted Outputs: token ids, or a text with tokenizer=...; a batch takes one
    per row, or None, in a list): drafted from by this call alone.
    """
    given = {n: v for n, v in zip(("k", "min_match", "max_match", "adaptive", "tree_width"),
                                  (k, min_match, max_match, adaptive, tree_width)) if v is not None}
    direct = generation_config is None  # called directly, not by model.generate
    if direct and input_ids is None:
        raise ValueError("pass input_ids (a [1, length] tensor of token ids)")
    if direct and not hasattr(model, "generate"):
        raise TypeError(f"{type(model).__name__} has no generate(); pass a transformers model")
    hook = lookup_decoding(LookupConfig(**given), stats=stats, proposer=proposer, generator=generator, memory=memory,
                           references=references, prediction=prediction, tokenizer=tokenizer,
                           streamer=streamer if direct else None)
    if direct:
        stop_strings = model_kwargs.pop("stop_strings", None)
        if stop_strings is not None:
            # transformers (5.x) drops `tokenizer` for a callable custom_generate and then refuses
            # stop_strings; build the very criterion it would have built.
            if tokenizer is None:
                raise ValueError("stop_strings need the model's tokenizer: pass tokenizer=...")
            stopping_criteria = StoppingCriteriaList([*(stopping_criteria or []),
                                                      StopStringCriteria(tokenizer, stop_strings)])
        return model.generate(input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                              custom_generate=hook, **model_kwargs)
    return hook(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
                streamer=streamer, inputs_tensor=inputs_tensor, **model_kwargs)
