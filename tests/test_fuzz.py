"""The differential fuzzer's CI sample: 200 cases of tests/stress/fuzz.py against plain generate.

The long run (>= 5,000 cases) is `python -m tests.stress.fuzz --cases 5000 --seed 1 --out ...`; its result is in
benchmarks/results/fuzz/. A failure prints the case's SEED:I; `python -m tests.stress.fuzz --replay SEED:I` replays it.
"""

import collections

from tests.stress import fuzz


def test_fuzz_sample_against_plain_generate():
    fuzz.quiet()
    outcomes, failures, accepted, drafters = collections.Counter(), [], 0, collections.Counter()
    for i in range(200):
        case = fuzz.make_case(0, i)
        outcome = fuzz.run_case(case)
        outcomes[outcome["result"]] += 1
        accepted += outcome["accepted"]
        if outcome["result"] == "same":
            drafters[case["drafter"]] += outcome["accepted"] > 0
        if outcome["result"] in fuzz.FAILURES:
            failures.append(f"0:{i} {outcome['result']} {outcome.get('error', '')}")
    assert not failures, failures
    # Guards against vacuity: most cases ran to the end, and every kind of drafter had drafts accepted.
    assert outcomes["same"] + outcomes["near_tie"] >= 120, outcomes
    assert accepted > 0 and all(drafters[d] > 0 for d in ("index", "tree", "memory", "references", "draft_model")), \
        drafters
