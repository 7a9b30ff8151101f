"""scripts/compat_table.py turns a junit report into the table of docs/models-and-caches.md (no model runs here
but tiny configs)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("compat_table", ROOT / "scripts" / "compat_table.py")
compat_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compat_table)

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_model_coverage" name="test_decoder_only[llama-0]" time="0.1"/>
<testcase classname="tests.test_model_coverage" name="test_decoder_only[llama-1]" time="0.1">
  <failure message="x"/></testcase>
<testcase classname="tests.test_model_coverage" name="test_recurrent_state_refused[mamba-LinearAttentionLayer]"
  time="0.1"/>
<testcase classname="tests.test_static_cache" name="test_static_cache_equals_plain[llama]" time="0.1"/>
<testcase classname="tests.test_dtypes" name="test_dtype[llama-torch.bfloat16-cpu]" time="0.1"/>
<testcase classname="tests.test_dtypes" name="test_dtype[llama-torch.float16-cuda]" time="0.1"><skipped/></testcase>
<testcase classname="tests.test_index" name="test_unrelated" time="0.1"/>
</testsuite></testsuites>"""


def test_table_from_report(tmp_path):
    junit = tmp_path / "r.xml"
    junit.write_text(REPORT)
    text = compat_table.table(compat_table.results(junit))
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines()[2:]}
    assert set(rows) == {"llama", "mamba"}
    assert "| LlamaForCausalLM | DynamicLayer | FAILED 1/2 | yes | yes |" in rows["llama"]
    assert "| MambaForCausalLM | LinearAttentionLayer | refused |" in rows["mamba"]
    assert "(cuda)" not in text                  # skipped tests fill no cell


def test_page_block_is_replaced(tmp_path):
    page = tmp_path / "models-and-caches.md"
    page.write_text(f"intro\n{compat_table.START}\nold\n{compat_table.END}\nrest\n")
    compat_table.write_page("| new |", page)
    assert page.read_text() == f"intro\n{compat_table.START}\n| new |\n{compat_table.END}\nrest\n"


def test_the_page_that_shows_the_table_has_its_block():
    """The default page holds exactly one block to fill, and the README holds none (the table lives in docs/)."""
    text = compat_table.PAGE.read_text(encoding="utf-8")
    assert text.count(compat_table.START) == 1 and text.count(compat_table.END) == 1
    assert text.index(compat_table.START) < text.index(compat_table.END)
    assert compat_table.START not in (ROOT / "README.md").read_text(encoding="utf-8")


def test_page_option_writes_elsewhere(tmp_path):
    junit = tmp_path / "r.xml"
    junit.write_text(REPORT)
    page = tmp_path / "page.md"
    page.write_text(f"{compat_table.START}\n{compat_table.END}\n")
    compat_table.main(["--junit", str(junit), "--page", str(page)])
    assert "| llama | LlamaForCausalLM |" in page.read_text()
