"""Write the model compatibility table of docs/models-and-caches.md from the coverage tests' results (never by hand).

    python3 scripts/compat_table.py                 # runs the coverage tests (~1.5 min on 2 CPU cores), writes the page
    python3 scripts/compat_table.py --junit r.xml   # builds the table from an existing pytest --junitxml report
    python3 scripts/compat_table.py --print         # prints the table instead of writing the page
    python3 scripts/compat_table.py --page PATH     # writes into another page (between the same markers)

Each coverage test's id starts with the family name (tests/tiny_models.py); the test function says
which column it fills. A cell is "yes" when every test behind it passed, "refused" when the test
asserts the clear UnsupportedCacheError and passed, "FAILED a/b" otherwise, "" when nothing tests it.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_FILES = ["tests/test_model_coverage.py", "tests/test_encoder_decoder.py", "tests/test_static_cache.py",
              "tests/test_dtypes.py"]
PAGE = ROOT / "docs" / "models-and-caches.md"      # the page that shows the table
START, END = "<!-- compat-table:start -->", "<!-- compat-table:end -->"

# test function -> (column, family when the test has no family parameter, True if passing means "refused")
TESTS = {
    "test_decoder_only": ("float32, default cache", None, False),
    "test_decoder_only_default_options": ("float32, default cache", None, False),
    "test_sliding_window_and_hybrid": ("float32, default cache", None, False),
    "test_windowed_cache_is_used_and_stays_bounded": ("float32, default cache", None, False),
    "test_recurrent_state_refused": ("float32, default cache", None, True),
    "test_recurrent_state_rolled_back": ("float32, default cache", "jamba", False),     # transformers >= 5.25
    "test_equals_plain_greedy": ("float32, default cache", None, False),
    "test_summary_that_quotes_its_article": ("float32, default cache", "bart", False),
    "test_return_dict_and_scores": ("float32, default cache", "bart", False),
    "test_static_cache_equals_plain": ("static cache", None, False),
    "test_static_cache_is_the_one_used": ("static cache", "llama", False),
    "test_compiled_forward_compiles_once_per_bucket": ("torch.compile + static", "gpt2", False),
    "test_static_sliding_window_refused": ("static cache", None, True),
    "test_dtype": (None, None, False),                      # column from the dtype/device in the id
    "test_dtype_static_cache": (None, "llama", False),
}
COLUMNS = ["float32, default cache", "static cache", "torch.compile + static", "bfloat16", "float16"]


def run_tests(junit: Path) -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *TEST_FILES]
    subprocess.run(cmd, cwd=ROOT, check=False)          # failures belong in the table, not in an exception


def results(junit: Path) -> dict:
    """{(family, column): [passed, total, refused]} from a junit report."""
    cells = defaultdict(lambda: [0, 0, False])
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "")
        m = re.fullmatch(r"(\w+)(?:\[(.*)\])?", name)
        if not m or m.group(1) not in TESTS:
            continue
        func, params = m.group(1), (m.group(2) or "").split("-")
        column, family, refusal = TESTS[func]
        if column is None:                               # test_dtype[family-torch.bfloat16-cpu]
            dtype = next(p.replace("torch.", "") for p in params if p.startswith("torch."))
            device = params[-1]
            column = dtype if device == "cpu" else f"{dtype} ({device})"
        family = family or params[0]
        if case.find("skipped") is not None:
            continue
        ok = case.find("failure") is None and case.find("error") is None
        cell = cells[(family, column)]
        cell[0] += ok
        cell[1] += 1
        cell[2] = cell[2] or refusal
    return cells


@functools.cache
def _tiny_models():
    """tests/tiny_models.py, loaded from its file: tests/ is not a package and this script runs from anywhere."""
    spec = importlib.util.spec_from_file_location("tiny_models", ROOT / "tests" / "tiny_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def describe(family: str) -> tuple[str, str]:
    """(model class, default cache layers) of the tiny config, read from the model itself."""
    from transformers import DynamicCache
    model = _tiny_models().build(family)
    if model.config.is_encoder_decoder:
        return type(model).__name__, "EncoderDecoderCache (self-attention cropped)"
    layers = [type(layer).__name__ for layer in DynamicCache(config=model.config).layers] or ["DynamicLayer"]
    return type(model).__name__, ", ".join(sorted(set(layers)))


def table(cells: dict) -> str:
    families = sorted({family for family, _ in cells})
    columns = [c for c in COLUMNS if any(col == c for _, col in cells)]
    columns += sorted({col for _, col in cells} - set(columns))
    lines = ["| family | model class | cache layers | " + " | ".join(columns) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in columns) + " |"]
    for family in families:
        cls, layers = describe(family)
        row = []
        for column in columns:
            passed, total, refused = cells.get((family, column), (0, 0, False))
            row.append("" if total == 0 else ("refused" if refused else "yes") if passed == total
                       else f"FAILED {total - passed}/{total}")
        lines.append(f"| {family} | {cls} | {layers} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_page(text: str, page: Path) -> None:
    """Replace the table between START and END (markers kept) in `page`."""
    content = page.read_text()
    if START not in content or END not in content:
        raise SystemExit(f"{page} has no {START} ... {END} block to fill")
    head, rest = content.split(START, 1)
    _, tail = rest.split(END, 1)
    page.write_text(f"{head}{START}\n{text}\n{END}{tail}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--junit", type=Path, help="existing pytest --junitxml report (default: run the tests)")
    parser.add_argument("--print", action="store_true", help="print the table instead of writing the page")
    parser.add_argument("--page", "--readme", dest="page", type=Path, default=PAGE,
                        help=f"the page to write the table into (default {PAGE.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    junit = args.junit
    if junit is None:
        junit = Path(tempfile.mkdtemp()) / "coverage.xml"
        run_tests(junit)
    text = table(results(junit))
    if args.print:
        print(text)
    else:
        write_page(text, args.page)
        print(f"wrote the compatibility table into {args.page}")


if __name__ == "__main__":
    main()
