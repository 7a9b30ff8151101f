"""Trees of candidates: construction, mask, cache compaction, and exactness end to end."""

import dataclasses

import numpy as np
import pytest
import torch
from conftest import VOCAB, FlatCosts, lookup_generate
from tiny_models import build

import lookup_decode
from lookup_decode import DecodeStats, Draft
from lookup_decode.core.verify import Rules, accept_tree
from lookup_decode.engines.hf.forward import tree_mask
from lookup_decode.sources.tree import TreeProposer, build_tree

GREEDY = dict(do_sample=False, pad_token_id=0)


def test_build_tree_merges_shared_prefixes():
    tree = build_tree([[5, 6, 7], [5, 8], [9], []])
    assert tree.tokens.tolist() == [5, 6, 7, 8, 9]
    assert tree.parents.tolist() == [-1, 0, 1, 0, -1]
    assert tree.depth.tolist() == [1, 2, 3, 2, 1]
    assert tree.chain.tolist() == [5, 6, 7]


def test_tree_mask_sees_ancestors_only():
    tree = build_tree([[5, 6], [9]])
    mask = tree_mask(tree, past=2, dtype=torch.float32, device="cpu")[0, 0] == 0
    assert mask.tolist() == [
        [True, True, True, False, False, False],    # root: past + itself
        [True, True, True, True, False, False],     # 5: past, root, itself
        [True, True, True, True, True, False],      # 6: past, root, 5, itself
        [True, True, True, False, False, True],     # 9: past, root, itself (not 5, 6)
    ]


def test_accept_tree_descends_on_matching_tokens():
    tree = build_tree([[5, 6, 7], [9, 4]])               # nodes: 5 6 7 9 4
    best = {0: 9, 4: 4, 5: 1}                            # row -> argmax: root says 9, node 9 says 4, node 4 says 1

    def rows(r, path):
        out = torch.zeros(1, VOCAB)
        out[0, best.get(r, 0)] = 1.0
        return out
    emitted, path, used = accept_tree(tree.tokens, tree.parents, rows, None)
    assert emitted.tolist() == [9, 4, 1] and path == [3, 4] and len(used) == 3


def branching_prompt(seed: int) -> torch.Tensor:
    """A block repeated with different continuations after the same 3-token key: trees have branches."""
    rng = np.random.default_rng(seed)
    key = rng.integers(3, VOCAB, 3).tolist()
    parts = []
    for _ in range(4):
        parts += key + rng.integers(3, VOCAB, 5).tolist()
    return torch.tensor([parts + key])


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_tree_greedy_equals_plain_generate(arch):
    model = build(arch)
    stats = DecodeStats()
    for seed in range(6):
        prompt = branching_prompt(seed)
        ref = model.generate(prompt, max_new_tokens=40, eos_token_id=None, **GREEDY)
        got = model.generate(prompt, max_new_tokens=40, eos_token_id=None, **GREEDY,
                             custom_generate=lookup_decode.generate, stats=stats, adaptive=False, k=6,
                             proposer=TreeProposer(width=4, min_match=1))
        assert got.tolist() == ref.tolist(), seed
    assert stats.accepted > 0 and stats.tree_steps > 0
    assert stats.off_chain > 0, "guard: a branch other than the chain's was accepted"


def test_tree_width_one_is_the_chain(tiny_llama):
    prompt = branching_prompt(0)
    outs = [tiny_llama.generate(prompt, max_new_tokens=30, eos_token_id=None, **GREEDY,
                                custom_generate=lookup_decode.generate, adaptive=False, k=6, proposer=p)
            for p in (TreeProposer(width=1), lookup_decode.SuffixIndex())]
    assert outs[0].tolist() == outs[1].tolist()


def test_trees_are_the_default_where_the_curve_gives_them_for_free(tiny_llama):
    """No proposer passed: one row's forward verifies trees, and on a flat cost curve the default sends them, with
    plain's output; tree_width=1 sends chains."""
    for width in (4, 1):
        stats = DecodeStats()
        for seed in range(4):
            prompt = branching_prompt(seed)
            ref = tiny_llama.generate(prompt, max_new_tokens=40, eos_token_id=None, **GREEDY)
            got = lookup_generate(tiny_llama, prompt, max_new_tokens=40, eos_token_id=None, **GREEDY, stats=stats,
                                  costs=FlatCosts(), tree_width=width)
            assert got.tolist() == ref.tolist(), (width, seed)
        assert stats.accepted > 0, "guard: drafts were kept"
        assert (stats.tree_steps > 0) == (width > 1), width


def test_a_chain_grows_its_tree_only_where_more_nodes_are_sent():
    """TreeProposer's branches scan the context: built only when the cut keeps more nodes than the chain's."""
    def no_tree():
        raise AssertionError("the tree was built")
    chain = dataclasses.replace(Draft(np.array([5, 6, 7], np.int32), 3), grow=no_tree)
    assert chain.cut(2, tree_nodes=2).tokens.tolist() == [5, 6]       # the budget holds the chain only
    assert chain.cut(2, tree_nodes=0).parents is None and chain.cut(0, tree_nodes=None).tokens.tolist() == []
    tree = dataclasses.replace(chain, grow=lambda: build_tree([[5, 6, 7], [9, 4]], 3)).cut(2, tree_nodes=4)
    assert tree.tokens.tolist() == [5, 6, 9, 4] and tree.parents.tolist() == [-1, 0, -1, 2]


def test_tree_proposer_rejects_bad_width():
    with pytest.raises(ValueError, match="width"):
        TreeProposer(width=0)


# ----------------------------------------------------------------------------- exact tree sampling

from test_sampling import ALPHA, CONFIGS, PROMPT, chi_square_pvalue, exact_joint, narrow_llama, sample_counts  # noqa: E402


@pytest.fixture(scope="module")
def narrow_model():
    """test_sampling's vocabulary-6 Llama: the joint distribution of its first tokens is enumerated exactly."""
    return narrow_llama()


def tree_sampler(stats, generator, rules=Rules()):
    def run(model, **gen_kwargs):
        hook = lookup_decode.lookup_decoding(k=4, adaptive=False, stats=stats, generator=generator, rules=rules,
                                             proposer=TreeProposer(width=3, min_match=1))
        return model.generate(PROMPT, max_new_tokens=3, do_sample=True, custom_generate=hook, **gen_kwargs)
    return run


def test_tree_sampling_matches_the_joint_distribution(narrow_model):
    # One configuration keeps the suite fast; the tree path runs the logits processors per visited
    # node exactly as the chain's row-by-row path does (top-k/top-p are covered there).
    gen_kwargs = CONFIGS["temperature_1"]
    target = exact_joint(narrow_model, **gen_kwargs)
    stats = DecodeStats()
    counts = sample_counts(narrow_model, tree_sampler(stats, torch.Generator().manual_seed(1)), **gen_kwargs)
    assert chi_square_pvalue(counts, target) > ALPHA
    assert stats.tree_steps > 0 and stats.accepted > 0, "guard: trees were verified and drafts kept"
    assert stats.off_chain > 0, "guard: a branch other than the chain's was kept"


def _descend_first_branch(tokens, parents, row_scores, uniforms):
    """Wrong rule: keeps the first branch whole, then samples one token (ignores the target on the way)."""
    path, node = [], -1
    rows = [row_scores(0, [])]
    while True:
        kids = [j for j in range(len(tokens)) if int(parents[j]) == node]
        if not kids:
            break
        node = kids[0]
        path.append(node)
        rows.append(row_scores(node + 1, path))
    from lookup_decode.core.verify import sample_rows
    x = sample_rows(torch.softmax(rows[-1], dim=-1), uniforms[len(path): len(path) + 1])
    return torch.cat([torch.as_tensor(tokens[path], dtype=torch.long), x.long()]), path, rows


def test_tree_sampling_negative_control_is_rejected(narrow_model):
    gen_kwargs = CONFIGS["temperature_1"]
    target = exact_joint(narrow_model, **gen_kwargs)
    stats = DecodeStats()
    sampler = tree_sampler(stats, torch.Generator().manual_seed(1), Rules(tree=_descend_first_branch))
    counts = sample_counts(narrow_model, sampler, **gen_kwargs)
    assert stats.tree_steps > 0
    assert chi_square_pvalue(counts, target) < ALPHA


def test_build_tree_budget_cuts_later_branches_first():
    tree = build_tree([[5, 6, 7], [5, 8, 9], [4, 4]]).cut(3, tree_nodes=4)
    assert tree.tokens.tolist() == [5, 6, 7, 8]      # the shared 5 is free; 9 and the third branch are cut
    assert tree.parents.tolist() == [-1, 0, 1, 0]
    assert build_tree([[1, 2]]).cut(2, tree_nodes=0).parents is None   # a tree cut to its chain is a chain


def test_tree_with_cost_model_equals_plain_generate(tiny_llama):
    # adaptive: the measured curve decides how many tree nodes are free; output must not change.
    for seed in range(3):
        prompt = branching_prompt(seed)
        ref = tiny_llama.generate(prompt, max_new_tokens=30, eos_token_id=None, **GREEDY)
        stats = DecodeStats()
        got = tiny_llama.generate(prompt, max_new_tokens=30, eos_token_id=None, **GREEDY,
                                  custom_generate=lookup_decode.generate, stats=stats, k=6,
                                  proposer=TreeProposer(width=4, min_match=1))
        assert got.tolist() == ref.tolist(), seed
