"""Short soak (issue 16): 8 generating threads share one Memory and one References while others save, load,
register, remove and evict. Counted in operations, not seconds; the long run is `python -m tests.stress.soak`."""

from tests.stress.soak import soak


def test_short_soak(tmp_path):
    result = soak(ops_per_thread=6, generators=8, workdir=str(tmp_path))
    assert result["failures"] == []
    assert result["generations"] == 48 and result["compared"] == 48
    assert result["saves"] == 6 and result["registers"] == 12
    assert result["max_memory_tokens"] <= result["memory_bound"]
    assert result["accepted_tokens"] > 0, "guard: drafts were accepted"
