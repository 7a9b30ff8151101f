"""Benchmark harness logic: interleaving, ratios and spreads, loop score, replay accounting, the
baseline proposers' rules, and `lookup-decode bench` input errors. No real model (one tiny one for
the batch harness) and no wall-clock thresholds."""

import json

import numpy as np
import pytest
import torch

from benchmarks.harness import report
from benchmarks.harness.baselines import (
    ContextCopyOracle,
    SelectionOracle,
    SubstitutionKey,
    SuffixDecoding,
    TransformersPromptLookup,
    VllmNgram,
)
from benchmarks.harness.loop import side_by_side
from benchmarks.harness.metrics import accepted_histogram
from benchmarks.harness.results import write_result
from benchmarks.replay import drafts as study
from benchmarks.replay import fingerprint
from lookup_decode import measure
from lookup_decode.cli import bench
from lookup_decode.core.cost import CostCurve
from lookup_decode.core.draft import Draft
from lookup_decode.core.index import SuffixIndex
from lookup_decode.core.stats import DecodeStats
from lookup_decode.engines import replay
from lookup_decode.engines.hf.ties import first_difference

# ------------------------------------------------------------------------------------ interleaving

def test_interleaved_order_rotates_each_repeat():
    assert measure.interleaved_order(["a", "b", "c"], 2) == [
        (0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a")]
    assert measure.interleaved_order(["a", "b", "c"], 1, offset=2) == [(0, "c"), (0, "a"), (0, "b")]


@pytest.mark.parametrize("n_variants,repeats,offset", [(1, 3, 0), (2, 4, 1), (4, 4, 0), (4, 8, 3)])
def test_interleaved_order_runs_every_variant_once_per_repeat(n_variants, repeats, offset):
    names = [f"v{i}" for i in range(n_variants)]
    order = measure.interleaved_order(names, repeats, offset)
    assert len(order) == n_variants * repeats
    for r in range(repeats):
        assert sorted(v for rr, v in order if rr == r) == names
    firsts = [order[r * n_variants][1] for r in range(repeats)]
    if repeats % n_variants == 0:   # over whole rotations every variant goes first equally often
        assert all(firsts.count(v) == repeats // n_variants for v in names)


class FakeModel:
    """Records generate() calls; appends fixed new tokens (the 'lookup' variant returns other tokens)."""

    def __init__(self):
        self.calls = []

    def generate(self, input_ids, **kwargs):
        name = "lookup" if "custom_generate" in kwargs else ("pld" if "prompt_lookup_num_tokens" in kwargs else "plain")
        self.calls.append((int(input_ids[0, 0]), name))
        if "stats" in kwargs:
            kwargs["stats"].observe(2, 1)
        new = torch.tensor([[7, 8, 9]]) if name != "lookup" else torch.tensor([[7, 8, 0]])
        return torch.cat([input_ids, new], dim=1)


def test_measure_follows_interleaved_order_and_records_tokens():
    model = FakeModel()
    prompts = [torch.tensor([[10, 1]]), torch.tensor([[11, 1]])]
    variants = [measure.PLAIN, measure.PROMPT_LOOKUP, measure.Variant("lookup", lookup={"k": 4})]
    measured = measure.measure(model, prompts, variants, max_new_tokens=3, repeats=2, progress=lambda: None)
    assert model.calls == [(10, "plain"), (10, "pld"), (10, "lookup"), (10, "pld"), (10, "lookup"), (10, "plain"),
                           (11, "pld"), (11, "lookup"), (11, "plain"), (11, "lookup"), (11, "plain"), (11, "pld")]
    assert measured[0]["plain"].tokens == [7, 8, 9]
    assert measured[0]["lookup"].tokens == [7, 8, 0]
    assert measured[0]["lookup"].stats.steps == 1
    summary = measure.compare(measured, "lookup")
    assert summary["identical"] == 0 and summary["n"] == 2
    json.dumps(summary)  # the --json output must serialize


def test_side_by_side_interleaves_and_keeps_every_run():
    calls = []
    runs = side_by_side(["a", "b"], lambda name: calls.append(name) or len(calls), repeats=2, offset=1)
    assert calls == ["b", "a", "a", "b"]                     # measure.interleaved_order, rotated by the offset
    assert runs == {"b": [1, 4], "a": [2, 3]} and list(runs) == ["b", "a"]   # names in the order they first ran


def test_write_result_writes_json_markdown_and_the_command(tmp_path, capsys):
    path = write_result(tmp_path / "out", "r", {"x": 1}, "# table\n")
    assert path == tmp_path / "out" / "r.json"
    saved = json.loads(path.read_text())
    assert saved["x"] == 1 and saved["command"]              # a result without a command gets the running one
    assert (tmp_path / "out" / "r.md").read_text() == "# table\n" and "# table" in capsys.readouterr().out
    write_result(tmp_path, "s", {"environment": {"command": "python -m x"}})
    assert "command" not in json.loads((tmp_path / "s.json").read_text())       # the environment names it
    assert not (tmp_path / "s.md").exists()


def test_fingerprint_is_deterministic_and_covers_every_step():
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 30, size=200).astype(np.int32)
    pairs = {"cnn_dm": [(prompt, np.concatenate([prompt[20:80], prompt[100:140]]))],
             "code_edit": [(prompt[:50], rng.integers(3, 30, size=40).astype(np.int32))]}
    rows = fingerprint.fingerprint(pairs, eos=[0])
    assert [r[0] for r in rows] == ["cap 10 fixed", "cap 10 adaptive", "cap 32 fixed", "cap 32 adaptive", "all"]
    assert rows[-1][1] == sum(r[1] for r in rows[:-1]) > 0
    assert fingerprint.fingerprint(pairs, eos=[0]) == rows
    other = {"cnn_dm": pairs["cnn_dm"], "code_edit": [(prompt[:50], prompt[:40])]}
    assert fingerprint.fingerprint(other, eos=[0])[-1][2] != rows[-1][2]


# ------------------------------------------------------------------------------ ratios and spread

def test_spread_quartiles_and_range():
    s = measure.spread([4, 1, 3, 2])
    assert s == {"n": 4, "median": 2.5, "q1": 1.75, "q3": 3.25, "min": 1.0, "max": 4.0}
    assert measure.spread([]) == {"n": 0, "median": None, "q1": None, "q3": None, "min": None, "max": None}


def test_speedup_is_a_ratio_of_tokens_per_second():
    assert measure.speedup((100, 10.0), (100, 5.0)) == pytest.approx(2.0)
    assert measure.speedup((100, 10.0), (50, 2.0)) == pytest.approx(2.5)     # different output lengths


def test_throughput_ratio_weighs_long_prompts_unlike_the_median():
    base = [(100, 10.0), (10, 10.0)]
    other = [(100, 5.0), (10, 10.0)]
    per_prompt = [measure.speedup(b, o) for b, o in zip(base, other)]
    assert measure.spread(per_prompt)["median"] == pytest.approx(1.5)
    assert measure.throughput_ratio(base, other) == pytest.approx((110 / 15) / (110 / 20))


def test_first_mismatch():      # the benchmarks' first_mismatch is the package's ties.first_difference
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_accepted_histogram_from_accepted_at():
    stats = DecodeStats()
    for drafted, accepted in [(3, 3), (3, 0), (2, 1), (0, 0)]:
        stats.observe(drafted, accepted)
    assert stats.accepted_at == [2, 1, 1]
    assert accepted_histogram(stats) == [2, 1, 0, 1]   # steps that kept exactly 0, 1, 2, 3 drafts
    assert accepted_histogram(DecodeStats()) == [0]


# -------------------------------------------------------------------------------------- loop score

def test_loop_score_worked_examples():
    assert measure.loop_score([]) == 0.0
    assert measure.loop_score(list(range(50))) == 0.0
    assert measure.loop_score([1, 2, 3] * 3, n=3) == pytest.approx(6 / 9)
    assert measure.loop_score([1, 2, 3, 4] * 4) == pytest.approx(12 / 16)   # 8-grams from position 4 on repeat
    block = list(range(100, 110))
    assert measure.loop_score(block + block) == pytest.approx(10 / 20)       # one copied 10-token block
    assert measure.loop_score([5] * 7) == 0.0                                 # shorter than one 8-gram


# ------------------------------------------------------------------------------------------ replay

PROMPT = [1, 2, 3, 4, 1, 2, 3]
OUTPUT = [4, 1, 2, 7, 1, 2, 3, 4]


# Worked by hand, cap 3. lookup_decode (min_match 2): [4,1,2] all kept + bonus 7; "7" and "7,1" have no
# match of 2 tokens (no draft); after "1,2" the earliest occurrence drafts [3] (capped: 1 token left
# before the last) -> kept + bonus 4. transformers PLD falls back to 1-grams: after "7,1" the first
# "1" (position 0) drafts [2,3] -> kept + bonus 4. vLLM (2..5) behaves as ours here. The oracle copies
# [4,1,2] then [1,2,3] (both occur in the context). The hand-worked lookup_decode row has re-sync off
# (resync_window=0); with it on, the copy of the prompt broke at "7" (anchor: position 7), so "1,2"
# re-syncs to the nearest occurrence, the output's own "1,2,7" (positions 8-10): drafts [7], wrong
# (truth 3); "3" then has no token left to draft for.
@pytest.mark.parametrize("make,draft_lengths,accepted_at", [
    (lambda: SuffixIndex(PROMPT, min_match=2, resync_window=0), [3, 0, 0, 1], [2, 1, 1]),
    (lambda: SuffixIndex(PROMPT, min_match=2), [3, 0, 0, 1, 0], [1, 1, 1]),
    (lambda: TransformersPromptLookup(PROMPT, num_output_tokens=3), [3, 0, 2], [2, 2, 1]),
    (lambda: VllmNgram(PROMPT, k=3, min_n=2, max_n=5), [3, 0, 0, 1], [2, 1, 1]),
    (lambda: ContextCopyOracle(PROMPT, OUTPUT), [3, 3], [2, 2, 2]),
    # SuffixDecoding: "1 2 3" (m = 3, 2 occurrences incl. the suffix itself) drafts [4,1,2] (prob 1/2
    # each); "7" has no continuation; after "7,1" the 1-gram "1" (3 of 4 occurrences go on with 2,
    # draft capped at floor(1 * factor) = 1 token) drafts [2] -> kept + bonus 3; then 0 tokens left.
    (lambda: SuffixDecoding(PROMPT, k=3), [3, 0, 1, 0], [2, 1, 1]),
    # Selection oracle: after "7,1" it copies from the "1" whose continuation is "2,3" (position 1).
    (lambda: SelectionOracle(PROMPT, OUTPUT), [3, 0, 2], [2, 2, 1]),
])
def test_replay_hand_worked(make, draft_lengths, accepted_at):
    stats = replay.replay(make(), OUTPUT, cap=3)
    assert stats.draft_lengths == draft_lengths
    assert stats.accepted_at == accepted_at
    assert stats.steps == len(draft_lengths)
    assert stats.new_tokens == len(OUTPUT)
    assert stats.steps + stats.accepted == len(OUTPUT)          # every step emits accepted + 1
    assert stats.mean_accepted_length == pytest.approx(len(OUTPUT) / len(draft_lengths))


def test_replay_feeds_exactly_the_true_tokens():
    index = SuffixIndex(PROMPT, min_match=2)
    replay.replay(index, OUTPUT, cap=3)
    assert index.tokens.tolist() == PROMPT + OUTPUT


class Scripted:
    """Drafts from a fixed list, one per step; records the max_tokens it was offered and what it was fed."""

    def __init__(self, drafts):
        self.drafts, self.offered, self.fed, self.match_len = list(drafts), [], [], 4

    def propose(self, max_tokens):
        self.offered.append(max_tokens)
        return Draft(np.asarray(self.drafts.pop(0)[:max_tokens], dtype=np.int32), self.match_len)

    def extend(self, tokens):
        self.fed.append(list(np.asarray(tokens).tolist()))


def test_replay_accounting_with_scripted_drafts():
    output = [5, 6, 7, 8, 9, 10]
    p = Scripted([[5, 6, 0], [], [9, 10, 11]])
    stats = replay.replay(p, output, cap=4)
    # step 1: [5,6] kept, 0 rejected -> emits 5,6,7; step 2: no draft -> emits 8;
    # step 3: offered 6-4-1 = 1 token -> [9] kept + bonus 10
    assert p.offered == [4, 2, 1]
    assert p.fed == [[5, 6, 7], [8], [9, 10]]
    assert stats.draft_lengths == [3, 0, 1]
    assert (stats.drafted, stats.accepted, stats.accepted_at) == (4, 3, [2, 1, 0])


def test_replay_with_policy_verifies_what_the_policy_chooses():
    from lookup_decode.core.policy import DraftPolicy

    class Fixed(DraftPolicy):
        def choose(self, drafts, p=None, room=None):
            return 1 + min(1, max(len(d) for d in drafts))

    index = SuffixIndex(PROMPT, min_match=2)
    stats = replay.replay(index, OUTPUT, cap=3, policy=Fixed(3))
    assert max(stats.draft_lengths) == 1
    assert index.tokens.tolist() == PROMPT + OUTPUT


def test_estimated_speedup_prices_each_step_as_one_forward():
    stats = DecodeStats(new_tokens=8)
    for d, a in [(3, 3), (0, 0), (0, 0), (1, 1)]:
        stats.observe(d, a)
    cost = lambda n: 1.0 + 0.1 * (n - 1)  # noqa: E731
    assert replay.estimated_seconds(stats, cost) == pytest.approx(1.3 + 1 + 1 + 1.1)
    assert replay.estimated_speedup(stats, cost) == pytest.approx(8 / 4.4)


def test_search_settings_ranks_every_setting():
    rng = np.random.default_rng(0)
    block = rng.integers(10, 500, size=40).tolist()
    prompts, outputs = [block + [1, 2]], [block[:30]]
    cost = CostCurve([1, 65], [1.0, 2.0], 65)
    rows = replay.search_settings(prompts, outputs, cost, eos_token_ids=[0], ks=(4, 16), min_matches=(1, 2))
    assert len(rows) == 2 * 2 * 2
    speeds = [r["estimated_speedup"] for r in rows]
    assert speeds == sorted(speeds, reverse=True)
    assert rows[0]["mean_accepted_length"] > 1.0


def copying_pair(seed=0):
    """A prompt over a small vocabulary and an output copying two of its spans around new text."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, 40, size=300).astype(np.int32)
    return prompt, np.concatenate([prompt[20:60], rng.integers(3, 40, size=10), prompt[100:150]]).astype(np.int32)


def test_measure_priors_counts_every_drafting_step():
    """replay.py --measure-priors: its counts agree with the DecodeStats of the same replay."""
    prompt, output = copying_pair()
    counts = study.prior_counts([(prompt, output)], cap=8, eos=[0])
    stats = replay.replay(study.PROPOSERS["lookup_decode"](prompt, output, 8, [0]), output, cap=8)
    assert stats.accepted > 0
    steps = [(d, a) for d, a in zip(stats.draft_lengths, stats.accepted_lengths) if d]
    assert counts[:, 1].sum() == len(steps)                              # first position: tried once per draft
    assert counts[:, 0].sum() == stats.accepted_at[0]                    # ... kept
    assert counts[:, 2].sum() == stats.accepted - stats.accepted_at[0]   # later positions kept
    assert counts[:, 3].sum() == sum(min(a, d - 1) for d, a in steps)    # later positions decided


def test_replay_tree_of_width_1_is_the_chain_replay():
    """replay.py --tree-widths: one branch keeps what the chain replay keeps, step for step."""
    prompt, output = copying_pair(1)
    chain = study.replay_tree([(prompt, output)], cap=8, width=1, eos=[0])
    stats = replay.replay(study.PROPOSERS["lookup_decode"](prompt, output, 8, [0]), output, cap=8)
    assert (chain["steps"], chain["emitted"]) == (stats.steps, len(output))
    assert chain["mean_accepted_length"] == pytest.approx(stats.mean_accepted_length) and stats.accepted > 0
    assert chain["nodes_per_step"] == pytest.approx(stats.drafted / stats.steps)


# ------------------------------------------------------------------------------ baseline proposers

@pytest.mark.parametrize("tokens,kwargs,expected", [
    ([2, 3, 8, 1, 2, 3, 9, 1, 2, 3], {}, [8, 1, 2, 3, 9, 1, 2, 3]),   # first (left-most) 2-gram, not the longest match
    ([4, 7, 5, 6, 7], {}, [5, 6, 7]),                                 # no 2-gram match: falls back to 1-gram
    ([1, 2, 3, 1, 2], {"num_output_tokens": 2}, [3, 1]),              # num_output_tokens caps the draft
    ([1, 2, 0, 5, 1, 2], {"eos_token_ids": [0]}, []),                 # EOS first: empty, no further search
    ([1, 2, 3, 0, 1, 2], {"eos_token_ids": [0]}, [3]),                # cut before EOS
    ([5, 6, 7], {}, []),                                              # nothing repeats
    ([9], {}, []),
])
def test_transformers_prompt_lookup_examples(tokens, kwargs, expected):
    assert TransformersPromptLookup(tokens, **kwargs).propose(100).tokens.tolist() == expected


@pytest.mark.parametrize("seed", range(6))
def test_transformers_prompt_lookup_matches_transformers(seed):
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator
    rng = np.random.default_rng(seed)
    for _ in range(40):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 30))).tolist()
        ngram, out = int(rng.integers(1, 4)), int(rng.integers(1, 8))
        ref = PromptLookupCandidateGenerator(eos_token_id=torch.tensor([0]), num_output_tokens=out,
                                             max_matching_ngram_size=ngram, max_length=1000)
        ids = torch.tensor([tokens])
        want = ref.get_candidates(ids)[0][0, len(tokens):].tolist()
        got = TransformersPromptLookup(tokens, num_output_tokens=out, max_matching_ngram_size=ngram,
                                       eos_token_ids=[0]).propose(100).tokens.tolist()
        assert got == want, (tokens, ngram, out)


@pytest.mark.parametrize("tokens,k,min_n,max_n,expected", [
    ([1, 2, 3, 4, 2, 3], 4, 2, 3, [4, 2, 3]),          # draft ends at the end of the context
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2, [4, 1]),
    ([2, 3, 8, 1, 2, 3, 9, 1, 2, 3], 10, 2, 5, [9, 1, 2, 3]),   # longest match wins over the first 2-gram
    ([2, 3, 8, 1, 2, 3, 9, 1, 2, 3], 10, 2, 2, [8, 1, 2, 3, 9, 1, 2, 3]),  # capped at max_n: earliest 2-gram
    ([5, 1, 2, 6, 1, 2, 7, 1, 2], 1, 2, 5, [6]),       # several matches of equal length: the earliest
    ([1, 1, 1], 10, 2, 5, [1]),                        # the occurrence may overlap the suffix
    ([4, 7, 5, 6, 7], 10, 2, 5, []),                   # below min_n
])
def test_vllm_ngram_examples(tokens, k, min_n, max_n, expected):
    assert VllmNgram(tokens, k=k, min_n=min_n, max_n=max_n).propose(100).tokens.tolist() == expected


def vllm_rule_brute_force(t, k, min_n, max_n):
    """(draft, match length) of vLLM's n-gram rule, by brute force."""
    L = len(t)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        for s in range(0, L - n):                      # occurrence t[s:s+n] ends at s+n-1 <= L-2
            if t[s:s + n] == t[L - n:]:
                return t[s + n: s + n + k], n
    return [], 0


@pytest.mark.parametrize("seed", range(6))
def test_vllm_ngram_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    for _ in range(100):
        t = rng.integers(0, 3, size=int(rng.integers(1, 60))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(1, 6))
        draft = VllmNgram(t, k=k, min_n=min_n, max_n=max_n).propose(100)
        assert (draft.tokens.tolist(), draft.match_len) == vllm_rule_brute_force(t, k, min_n, max_n), \
            (t, k, min_n, max_n)


def test_context_copy_oracle_matches_brute_force():
    rng = np.random.default_rng(7)
    for _ in range(100):
        t = rng.integers(0, 3, size=int(rng.integers(1, 20))).tolist()
        future = rng.integers(0, 3, size=int(rng.integers(1, 8))).tolist()
        best = max((m for m in range(len(future) + 1)
                    if any(t[j:j + m] == future[:m] for j in range(len(t) - m + 1))), default=0)
        assert ContextCopyOracle(t, future).propose(100).tokens.tolist() == future[:best]


def test_baselines_extend_past_their_initial_buffer():
    p = VllmNgram([1, 2], k=3, min_n=2, max_n=2)
    p.extend(list(range(3, 3000)))
    p.extend([1, 2])
    assert p.propose(3).tokens.tolist() == [3, 4, 5]


# ------------------------------------------------------------------------------------ bench inputs

def write(tmp_path, name, text, mode="w"):
    path = tmp_path / name
    if mode == "wb":
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_read_requests_jsonl_and_folder(tmp_path):
    path = write(tmp_path, "reqs.jsonl", '{"prompt": "hi"}\n\n{"messages": [{"role": "user", "content": "yo"}]}\n')
    reqs = bench.read_requests(path)
    assert [r.id for r in reqs] == ["reqs.jsonl:1", "reqs.jsonl:3"]
    assert reqs[0].messages == [{"role": "user", "content": "hi"}]
    folder = tmp_path / "txt"
    folder.mkdir()
    write(folder, "b.txt", "second")
    write(folder, "a.txt", "first")
    write(folder, "notes.md", "ignored")
    assert [(r.id, r.messages[0]["content"]) for r in bench.read_requests(folder)] == [("a.txt", "first"),
                                                                                       ("b.txt", "second")]


@pytest.mark.parametrize("content,line,words", [
    ('{"prompt": "ok"}\n{"prompt": "no closing quote}\n', 2, "not valid JSON"),
    ('{"text": "wrong field"}\n', 1, "missing field"),
    ('["a", "list"]\n', 1, "JSON object"),
    ('{"prompt": ""}\n', 1, "non-empty"),
    ('{"prompt": "ok"}\n{"messages": []}\n', 2, "messages"),
    ('{"messages": [{"role": "user"}]}\n', 1, "messages[0]"),
])
def test_read_requests_names_file_and_line(tmp_path, content, line, words):
    path = write(tmp_path, "bad.jsonl", content)
    with pytest.raises(SystemExit) as err:
        bench.read_requests(path)
    message = str(err.value)
    assert f"{path}:{line}:" in message and words in message


@pytest.mark.parametrize("setup,words", [
    (lambda d: write(d, "empty.jsonl", ""), "empty"),
    (lambda d: write(d, "blank.jsonl", "\n  \n"), "empty"),
    (lambda d: d / "missing.jsonl", "no such file"),
    (lambda d: write(d, "latin1.jsonl", b'{"prompt": "caf\xe9"}\n', "wb"), "cannot read"),
])
def test_read_requests_bad_files(tmp_path, setup, words):
    path = setup(tmp_path)
    with pytest.raises(SystemExit) as err:
        bench.read_requests(path)
    assert str(path) in str(err.value) and words in str(err.value)


def test_read_requests_bad_folders(tmp_path):
    with pytest.raises(SystemExit, match="no .txt files"):
        bench.read_requests(tmp_path)
    empty = write(tmp_path, "empty.txt", "  \n")
    with pytest.raises(SystemExit) as err:
        bench.read_requests(tmp_path)
    assert str(empty) in str(err.value)


def test_bench_command_rejects_bad_input_before_loading_a_model(tmp_path):
    from lookup_decode.cli.commands import main
    path = write(tmp_path, "bad.jsonl", "{oops\n")
    with pytest.raises(SystemExit) as err:
        main(["bench", "--prompts", str(path)])
    assert f"{path}:1:" in str(err.value)


# ----------------------------------------------------------------------------------- aggregation

def record(category, loop, plain_s, pld_s, lookup_s, identical=True, tokens=100):
    seconds = {"plain": plain_s, "prompt_lookup": pld_s, "lookup_decode": lookup_s}
    variants = {n: {"seconds": s, "new_tokens": tokens, "tokens_per_second": tokens / s, "identical": True}
                for n, s in seconds.items()}
    variants["lookup_decode"]["identical"] = identical
    variants["lookup_decode"]["stats"] = {"steps": 50, "drafted": 100, "accepted": 50, "new_tokens": tokens,
                                          "total_s": lookup_s, "proposer_s": 0.01 * lookup_s,
                                          "model_s": 0.9 * lookup_s, "prefill_s": 0.05 * lookup_s}
    return {"category": category, "loop_score": loop, "variants": variants,
            "speedup_vs_plain": {n: plain_s / s for n, s in seconds.items() if n != "plain"},
            "speedup_vs_prompt_lookup": {n: pld_s / s for n, s in seconds.items() if n != "prompt_lookup"}}


def test_aggregate_per_category_with_and_without_loops():
    records = [record("code", 0.1, 10, 5, 4), record("code", 0.9, 10, 2, 1, identical=False),
               record("chat", 0.0, 10, 10, 8), record("chat", 0.2, 10, 8, 10)]
    names = ["plain", "prompt_lookup", "lookup_decode"]
    agg = report.aggregate(records, names, loop_threshold=0.5)
    full, clean = agg["all_prompts"], agg["without_loops"]
    assert full["code"]["n"] == 2 and clean["code"]["n"] == 1 and clean["all"]["n"] == 3
    assert full["code"]["lookup_decode"]["speedup_vs_plain"]["median"] == pytest.approx((2.5 + 10) / 2)
    assert clean["code"]["lookup_decode"]["speedup_vs_plain"]["median"] == pytest.approx(2.5)
    assert full["code"]["lookup_decode"]["identical"] == 1 and clean["code"]["lookup_decode"]["identical"] == 1
    assert full["chat"]["lookup_decode"]["speedup_vs_prompt_lookup"]["min"] == pytest.approx(0.8)
    assert full["chat"]["lookup_decode"]["throughput_ratio_vs_plain"] == pytest.approx(20 / 18)
    assert full["all"]["lookup_decode"]["mean_accepted_length"] == pytest.approx(2.0)
    assert full["all"]["lookup_decode"]["acceptance_rate"] == pytest.approx(0.5)
    assert "speedup_vs_plain" not in full["all"]["plain"]
    text = report.markdown({"environment": {"command": "x", "device": "cpu", "cpu": "c", "torch_threads": 2,
                                            "torch": "t", "transformers": "t", "numba": "n"},
                            "settings": {"variants": names, "max_new_tokens": 8, "repeats": 1, "loop_threshold": 0.5,
                                         "variant_descriptions": names},
                            "aggregate": agg})
    assert "| code | 1 |" in text and "without loop-dominated prompts" in text


def suffix_decoding_brute_force(t, k, depth=24, factor=1.0, min_prob=0.1):
    """SuffixDecoding's path rule from explicit substring counts (a depth-limited count trie)."""
    L = len(t)

    def count(s):
        return sum(1 for i in range(L - len(s) + 1) if t[i:i + len(s)] == s)

    def first_at(s):
        return min(i for i in range(L - len(s) + 1) if t[i:i + len(s)] == s)

    best, best_score, best_m = [], 0.0, 0
    for m in range(1, min(depth, L)):
        s = t[L - m:]
        if count(s) == 0:
            break
        draft, prob, score, node = [], 1.0, 0.0, list(s)
        while len(draft) < min(k, int(m * factor + 1e-6)) and len(node) < depth:
            children = {c: count(node + [c]) for c in set(t)}
            children = {c: n for c, n in children.items() if n > 0}
            if not children:
                break
            top = max(children.values())
            c = min((c for c, n in children.items() if n == top), key=lambda c: first_at(node + [c]))
            prob *= top / count(node)
            if prob < min_prob:
                break
            draft.append(c)
            score += prob
            node.append(c)
        if score >= best_score:
            best, best_score, best_m = draft, score, m
    return best, best_m


@pytest.mark.parametrize("seed", range(4))
def test_suffix_decoding_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    for _ in range(40):
        t = rng.integers(0, 3, size=int(rng.integers(1, 40))).tolist()
        k, depth = int(rng.integers(1, 12)), int(rng.integers(2, 10))
        factor = float(rng.choice([0.5, 1.0, 2.0]))
        got = SuffixDecoding(t, k=k, max_tree_depth=depth, max_spec_factor=factor).propose(100)
        draft = got.tokens.tolist()
        assert (draft, got.match_len if draft else 0) == \
            (lambda d, m: (d, m if d else 0))(*suffix_decoding_brute_force(t, k, depth, factor)), (t, k, depth)


def test_suffix_decoding_docstring_example():
    d = SuffixDecoding([1, 2, 3, 1, 2, 3, 1, 2]).propose(10)
    assert d.tokens.tolist() == [3, 1, 2] and d.match_len == 5


def test_selection_oracle_matches_brute_force():
    rng = np.random.default_rng(8)
    kept_any = 0
    for _ in range(100):
        t = rng.integers(0, 3, size=int(rng.integers(2, 25))).tolist()
        future = rng.integers(0, 3, size=int(rng.integers(1, 8))).tolist()
        L = len(t)

        def kept(start):
            n = 0
            while n < len(future) and start + n < L and t[start + n] == future[n]:
                n += 1
            return n
        best = max((kept(e + 1) for e in range(L - 1) if t[e] == t[L - 1]), default=0)
        draft = SelectionOracle(t, future).propose(100).tokens.tolist()
        assert kept_of(draft, future) == best
        kept_any += best > 0
    assert kept_any > 20


def kept_of(draft, future):
    n = 0
    while n < min(len(draft), len(future)) and draft[n] == future[n]:
        n += 1
    return n


def test_substitution_key_skips_the_replaced_token():
    # Source 5 6 7 8 9 copied as 5 6 X: "X" matches nothing, so the draft resumes one past 7.
    p = SubstitutionKey([0, 5, 6, 7, 8, 9, 0, 5], min_len=2)
    assert p.propose(2).tokens.tolist() == [6, 7]
    p.extend([6, 42])
    assert p.propose(3).tokens.tolist() == [8, 9, 0]


def test_bench_batch_measure_accounts_tokens_and_decode_time(tiny_llama):
    """bench_batch.measure on a left-padded batch of 2: rows identical to plain, tokens counted up to each
    row's EOS, decode-only time taken from the same run (after the first token), never longer than the run."""
    from types import SimpleNamespace

    from conftest import repetitive_prompt

    from benchmarks.e2e import batch as bench_batch
    rows = [repetitive_prompt(1)[0], repetitive_prompt(2, length=10)[0]]
    P = max(len(r) for r in rows)
    ids = torch.zeros((2, P), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, P - len(r):], mask[i, P - len(r):] = r, 1
    tokenizer = SimpleNamespace(eos_token="</s>", convert_tokens_to_ids=lambda toks: [2], pad_token_id=0)
    rec = bench_batch.measure(tiny_llama, tokenizer, ids, mask, max_new_tokens=12, repeats=2)
    assert rec["rows"] == 2 and rec["lookup_decode"]["identical_rows"] == 2
    for name in ("plain", "lookup_decode"):
        r = rec[name]
        assert len(r["seconds_all"]) == len(r["first_token_s_all"]) == 2
        assert all(0 < f < s for f, s in zip(r["first_token_s_all"], r["seconds_all"]))
        assert r["new_tokens"] <= 2 * 12
        assert r["decode_tokens_per_second"] > 0
    assert rec["speedup"] == rec["lookup_decode"]["tokens_per_second"] / rec["plain"]["tokens_per_second"]
    assert rec["lookup_decode"]["stats"]["steps"] > 0


# ------------------------------------------------------------------------------ prompt selection and the model

def test_select_takes_the_first_n_that_fit_in_data_or_seeded_order():
    from benchmarks.harness import workloads
    sizes = {"qa": [50, 500, 20, 30], "aider_refactor": [900, 700, 100]}

    def load(name):
        return [workloads.Request(name, f"{name}/{i}", [{"role": "user", "content": "x" * n}])
                for i, n in enumerate(sizes[name])]

    def encode(req):
        return torch.zeros(1, len(req.messages[0]["content"]), dtype=torch.long)
    chosen, skipped = workloads.select(["qa"], None, 2, 100, encode=encode, load=load)
    assert [r.id for r, _ in chosen] == ["qa/0", "qa/2"] and skipped == {"qa": 1}
    everything, _ = workloads.select(["qa"], None, None, None, encode=encode, load=load)
    assert len(everything) == 4
    longs, skipped = workloads.select(["qa", "aider_refactor"], None, 5, 100, long_prompt_tokens=800,
                                      encode=encode, load=load)
    assert sorted(ids.shape[1] for r, ids in longs if r.category == "aider_refactor") == [100, 700]
    fit, _ = workloads.select(["qa"], None, 5, 100, context=80, max_new_tokens=40, encode=encode, load=load)
    assert [ids.shape[1] for _, ids in fit] == [20, 30]            # 50 + 40 > 80
    a, _ = workloads.select(["qa"], None, 4, None, seed=3, encode=encode, load=load)
    b, _ = workloads.select(["qa"], None, 4, None, seed=3, encode=encode, load=load)
    assert [r.id for r, _ in a] == [r.id for r, _ in b]
    assert sorted(r.id for r, _ in a) == [f"qa/{i}" for i in range(4)]


def test_model_arguments_and_their_meaning(monkeypatch):
    import argparse

    import lookup_decode
    from benchmarks.harness import model
    ap = argparse.ArgumentParser()
    model.add_model_arguments(ap)
    args = ap.parse_args([])
    assert args.model is None and args.dtype == "float32"
    assert ap.parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        ap.parse_args(["--dtype", "int8"])
    assert model.model_path(None) is None and model.model_path("x.gguf") == "x.gguf"
    monkeypatch.setattr(lookup_decode, "code_model", lambda: "/cache/qwen.gguf", raising=False)
    assert model.model_path(model.CODE_MODEL) == "/cache/qwen.gguf"


def test_code_model_folder_for_vllm_is_exported_once(monkeypatch, tmp_path):
    import lookup_decode
    from benchmarks.harness import model
    from lookup_decode.engines.hf import models
    gguf = tmp_path / "qwen.gguf"
    monkeypatch.setattr(lookup_decode, "code_model", lambda: gguf, raising=False)
    exported = []

    def export_hf(folder, path):
        exported.append((folder, path))
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    monkeypatch.setattr(models, "export_hf", export_hf)
    assert model.hf_folder(None) is None and model.hf_folder("/m") == "/m"
    assert model.hf_folder(model.CODE_MODEL) == str(tmp_path / "qwen-hf")
    assert model.hf_folder(model.CODE_MODEL) == str(tmp_path / "qwen-hf")
    assert exported == [(tmp_path / "qwen-hf", gguf)]


def test_batch_rows_are_left_padded():
    from benchmarks.e2e.batch import left_padded
    ids, mask = left_padded([torch.tensor([5, 6, 7]), torch.tensor([8])], pad=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
