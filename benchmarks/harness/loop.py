"""The side-by-side loop of every end-to-end study: for one unit of work (a prompt, a batch, a session step, a
prompt at one temperature), run each variant, interleaved (`lookup_decode.measure.interleaved_order`: every
variant once per repeat, the order rotated per repeat and by `offset`, e.g. the unit's index), after the study's
own untimed warm-up. A study is its axis (what a unit is, what a run does) and its table.
"""

from __future__ import annotations

from collections.abc import Callable

from lookup_decode.measure import interleaved_order


def side_by_side(names: list[str], run: Callable[[str], object], repeats: int = 1, offset: int = 0,
                 progress: Callable[[], object] | None = None) -> dict[str, list]:
    """{name: [run(name) of each repeat]}, the runs interleaved; the names in the order they first ran.

    Example: side_by_side(["a", "b"], f, repeats=2, offset=1) calls f("b"), f("a"), f("a"), f("b") and returns
    {"b": [f("b"), f("b")], "a": [f("a"), f("a")]} (with each call's own result).
    """
    runs: dict[str, list] = {}
    for _, name in interleaved_order(list(names), repeats, offset):
        runs.setdefault(name, []).append(run(name))
        if progress is not None:
            progress()
    return runs
