"""Processors: prefix-free tails run once over all rows and give exactly the per-row scores."""

import torch
from transformers import (LogitsProcessorList, MinPLogitsWarper, NoRepeatNGramLogitsProcessor,
                          RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
                          TopPLogitsWarper)

from lookup_decode.verify import Processors


def test_only_a_prefix_free_tail_is_split_off():
    rep, temp, topp = RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9)
    p = Processors(LogitsProcessorList([rep, temp, topp]))
    assert p.per_row == [rep] and p.at_once == [temp, topp]
    # A prefix-dependent processor after a warper keeps everything before it per row: order is kept.
    q = Processors([temp, rep, topp])
    assert q.per_row == [temp, rep] and q.at_once == [topp]
    assert not Processors(None) and not Processors([])


def test_tail_on_all_rows_equals_row_by_row():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(7, 500, generator=g) * 3
    procs = [TemperatureLogitsWarper(0.7), TopKLogitsWarper(40), TopPLogitsWarper(0.95), MinPLogitsWarper(0.05)]
    p = Processors(procs)
    together = p.tail(scores)
    ids = torch.zeros((1, 3), dtype=torch.long)
    for i in range(7):
        alone = scores[i: i + 1]
        for proc in procs:
            alone = proc(ids, alone)
        assert torch.equal(together[i: i + 1], alone)


def test_call_applies_head_then_tail_like_the_list():
    ids = torch.tensor([[3, 4, 3, 4, 3]])
    scores = torch.randn(1, 10, generator=torch.Generator().manual_seed(1))
    procs = [RepetitionPenaltyLogitsProcessor(1.5), NoRepeatNGramLogitsProcessor(2), TemperatureLogitsWarper(0.5),
             TopKLogitsWarper(4)]
    assert torch.equal(Processors(procs)(ids, scores.clone()), LogitsProcessorList(procs)(ids, scores.clone()))
