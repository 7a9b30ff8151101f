"""The front page and docs/ stay alive: links resolve, named commands exist, the README stays a front page.

Checked in README.md, ARCHITECTURE.md and docs/*.md:
* every relative link (and image) points at a file or folder of the repository, and a `#anchor` at a heading of
  the target page (GitHub's slug rules);
* every `python -m benchmarks...`, `python -m tests.stress...` and `python -m lookup_decode...` module exists as a
  file (never imported), and every repository script run with `bash`/`python` exists;
* every `lookup-decode COMMAND --option` written in code is a command and option of the CLI's parser, and
  docs/options.md lists every option of every command;
* README.md is at most 250 lines, keeps the set-up block `.ci/run` reads, and its compact results tables carry the
  numbers of the full results they summarise.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, ROOT / "ARCHITECTURE.md", *sorted(DOCS.glob("*.md"))]
MAX_README_LINES = 250

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})[^\n]*\n.*?^ {0,3}\1[ \t]*$", re.MULTILINE | re.DOTALL)
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
MODULE = re.compile(r"\bpython3?\s+-m\s+((?:benchmarks|tests\.stress|lookup_decode)(?:\.\w+)*)(?=[\s`'\")\]]|$)")
SCRIPT = re.compile(r"(?:^|[\s`(])(?:bash|python3?)\s+((?:[\w.-]+/)+[\w.-]+\.(?:sh|py))\b", re.MULTILINE)
CLI = re.compile(r"\blookup-decode[ \t]+([a-z][\w-]*)([^\n`]*)")


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _prose(text: str) -> str:
    """The page without its fenced code blocks (links and headings there are not links or headings)."""
    return FENCE.sub("", text)


def _code(text: str) -> list[str]:
    """Every fenced block (continuation lines joined) and inline code span: where commands are written."""
    blocks = [m.group(0).replace("\\\n", " ") for m in FENCE.finditer(text)]
    spans = re.findall(r"(?<!`)`((?:[^`\n]|\n(?![ \t]*\n))+)`(?!`)", _prose(text))   # within a paragraph
    return blocks + [span.replace("\n", " ") for span in spans]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower case, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)           # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)                                   # inline html
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(_prose(_text(page))):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(_prose(_text(page)))]


def test_the_pages_exist():
    assert README.exists() and (ROOT / "ARCHITECTURE.md").exists()
    names = {p.name for p in DOCS.glob("*.md")}
    for name in ("how-it-works.md", "options.md", "vllm.md", "batch-jobs.md", "memory-and-references.md",
                 "benchmarks.md", "transformers-versions.md", "models-and-caches.md", "cpu-notes.md", "limits.md",
                 "development.md"):
        assert name in names, f"docs/{name} is missing"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / target.split("#")[0]).resolve() for target in links(README)}
    for page in DOCS.glob("*.md"):
        assert page.resolve() in linked, f"README.md does not link {page.relative_to(ROOT)}"


def test_slug_follows_github():
    assert slug("Set up and run (two commands)") == "set-up-and-run-two-commands"
    assert slug("`lookup-decode run`") == "lookup-decode-run"
    assert slug("Large models' outputs on real forwards") == "large-models-outputs-on-real-forwards"
    assert slug("Through vLLM (`--engine vllm`)") == "through-vllm---engine-vllm"
    assert slug("In Python: the `generate()` hook") == "in-python-the-generate-hook"
    assert slug("vLLM's CPU build") == "vllms-cpu-build"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):             # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page.resolve()
        if not dest.is_relative_to(ROOT) or not dest.exists():
            broken.append(f"{target}: no such file in the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def _module_file(name: str) -> Path | None:
    """The file `python -m name` runs, found on disk (nothing is imported)."""
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__main__.py"):
        if candidate.is_file():
            return candidate
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_m_modules_exist(page):
    """Benchmarks, stress tools and the package's own modules named as `python -m ...` (in code or prose)."""
    missing = sorted({m.group(1) for m in MODULE.finditer(_text(page)) if _module_file(m.group(1)) is None})
    assert not missing, f"{page.relative_to(ROOT)} names modules that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_scripts_exist(page):
    """Repository scripts run with bash or python (a path with a folder: `bash scripts/setup.sh`)."""
    missing = sorted({m.group(1) for m in SCRIPT.finditer(_text(page)) if not (ROOT / m.group(1)).is_file()})
    assert not missing, f"{page.relative_to(ROOT)} runs scripts that do not exist: {missing}"


def _parser_options() -> dict[str, set[str]]:
    """{command: its option strings} from the CLI's own parser."""
    import argparse

    from lookup_decode.cli.commands import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: set(p._option_string_actions) for name, p in sub.choices.items()}


def _commands(page: Path):
    """(command, options) of every `lookup-decode COMMAND ...` written in code on the page."""
    for code in _code(_text(page)):
        for m in CLI.finditer(code):
            rest = re.split(r"\s#|\||&&|;|\)", m.group(2))[0]        # up to a comment or the next command
            yield m.group(1), re.findall(r"(?<![\w-])--[a-z][\w-]*", rest)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_cli_commands_and_options_exist(page):
    options = _parser_options()
    wrong = []
    for command, flags in _commands(page):
        if command not in options:
            wrong.append(f"lookup-decode {command}: no such command (the CLI has {sorted(options)})")
            continue
        wrong += [f"lookup-decode {command} {flag}: no such option" for flag in flags if flag not in options[command]]
    assert not wrong, f"{page.relative_to(ROOT)}: " + "; ".join(sorted(set(wrong)))


def test_readme_names_its_commands():
    """The front page shows each way of using the CLI it promises."""
    named = {command for command, _ in _commands(README)}
    assert {"generate", "bench", "run", "chat", "export-hf"} <= named


def test_options_page_lists_every_cli_option():
    text = _prose(_text(DOCS / "options.md"))
    sections = dict(re.findall(r"^### `lookup-decode ([\w-]+)`\n(.*?)(?=^#{1,3} |\Z)", text, re.MULTILINE | re.DOTALL))
    for command, flags in _parser_options().items():
        assert command in sections, f"docs/options.md has no section for lookup-decode {command}"
        documented = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", sections[command]))
        assert flags - {"-h", "--help"} <= documented, \
            f"docs/options.md, lookup-decode {command}: undocumented {sorted(flags - {'-h', '--help'} - documented)}"
        assert documented <= flags, f"docs/options.md, lookup-decode {command}: no such {sorted(documented - flags)}"


def test_options_page_lists_every_generate_option():
    import inspect

    import lookup_decode
    text = _text(DOCS / "options.md")
    params = inspect.signature(lookup_decode.generate).parameters
    options = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and n != "inputs_tensor"]  # transformers'
    assert options, "generate() has no keyword-only options?"
    missing = [n for n in options if f"| `{n}` |" not in text]
    assert not missing, f"docs/options.md does not list generate() options {missing}"


def test_readme_is_a_front_page():
    lines = _text(README).splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"


def test_readme_keeps_the_setup_block_ci_reads():
    """.ci/run: awk '/^## Set up and run/{f=1} f&&/^```bash/{b=1;next} b&&/^```/{exit} b' README.md"""
    lines, block, state = _text(README).splitlines(), [], None
    for line in lines:
        if state is None and line.startswith("## Set up and run"):
            state = "heading"
        elif state == "heading" and line.startswith("```bash"):
            state = "block"
        elif state == "block":
            if line.startswith("```"):
                break
            block.append(line)
    assert block, "README.md has no ```bash block under '## Set up and run'"
    assert len(block) == 2 and all(line.startswith("bash scripts/setup.sh && ") for line in block), block


def _table(text: str, after: str) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the first Markdown table after the line that starts with `after`."""
    lines = text[text.index(after):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows[0], rows[2:]                                          # the header; the rows after its rule


RESULTS = ROOT / "benchmarks" / "results"
# The README's compact tables and the full results they summarise (the code model in bfloat16, issue 32).
README_TRANSFORMERS = RESULTS / "generate" / "code_model_bf16_avx512" / "results.md"
README_VLLM = RESULTS / "vllm" / "engine_code_model_bf16_steps.md"
# README's transformers columns named otherwise in the full results (the rest have the same name there).
RESULT_COLUMN = {"vs prompt lookup": "vs prompt_lookup", "after 1st token vs prompt lookup": "after 1st token vs p.l."}


def _named(header: list[str], row: list[str]) -> dict[str, str]:
    return dict(zip(header, row, strict=True))


def test_readme_transformers_table_matches_the_full_results():
    """Each cell of the README's transformers table is the median of the same column of lookup_decode's table
    (prompts without loops) in the full results."""
    header, full = _table(_text(README_TRANSFORMERS), "### lookup_decode (without loop-dominated prompts)")
    full = {row[0]: _named(header, row) for row in full}
    short_header, short = _table(_text(README), "**transformers**")
    assert short, "README.md has no transformers results table"
    for row in short:
        mine, theirs = _named(short_header, row), full[row[0]]
        for column, cell in mine.items():
            assert cell == theirs[RESULT_COLUMN.get(column, column)].split()[0], (row[0], column)


def test_readme_vllm_table_matches_the_engine_results():
    """tok/s of each method (median over repeats) and lookup_decode's paired ratio over suffix, cold cells, from the
    engine study's full results."""
    engine = _text(README_VLLM)
    header, short = _table(_text(README), "**vLLM**")
    assert short, "README.md has no vLLM results table"
    methods = header[2:-1]                                            # workload, batch, methods..., ratio
    for workload, batch, *cells in short:
        t_header, rows = _table(engine, f"## {workload}, batch {batch}, cold")
        rows = {r[0]: _named(t_header, r) for r in rows}
        for method, cell in zip(methods, cells[:-1], strict=True):
            assert cell == rows[method]["tok/s median"], (workload, batch, method)
        assert cells[-1] == rows["suffix"]["lookup_decode / this, paired"].split()[0], (workload, batch)
