"""Processors: prefix-free tails run once over all rows and give exactly the per-row scores."""

import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lookup_decode.core.verify import Processors


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


class RowIndexed:
    """A prefix-dependent processor that reads each row's index in the batch (like prefix_allowed_tokens_fn)."""

    def __call__(self, input_ids, scores):
        return scores + torch.arange(scores.shape[0], dtype=scores.dtype)[:, None] * (input_ids[:, -1:] == 3)


def test_one_row_alone_scores_as_the_whole_batch_does():
    # Row-local views (repetition penalty with per-row padding lengths, no-repeat n-gram, min new tokens) score
    # row b alone exactly as the [B, length] batch call scores it; a processor that is not known to be row-local
    # (it reads the row's index) still runs on the whole batch.
    from transformers import MinNewTokensLengthLogitsProcessor
    g = torch.Generator().manual_seed(2)
    B, V, L = 6, 40, 30
    ids = torch.randint(0, V, (B, L), generator=g)
    pads = torch.tensor([0, 3, 0, 7, 1, 2])
    for procs, local in [([RepetitionPenaltyLogitsProcessor(1.4, prompt_ignore_length=pads),
                           NoRepeatNGramLogitsProcessor(2), MinNewTokensLengthLogitsProcessor(5, 10, [0])], True),
                         ([RepetitionPenaltyLogitsProcessor(1.4, prompt_ignore_length=pads), RowIndexed()], False)]:
        p = Processors(procs)
        assert p.row_local is local
        for b in range(B):
            for length in (12, 30):
                row = torch.randn(1, V, generator=g)
                batch = row.expand(B, -1).clone()
                want = LogitsProcessorList(procs)(ids[:, :length], batch)[b: b + 1]
                assert torch.equal(p.head_row(ids, b, length, row), want)
