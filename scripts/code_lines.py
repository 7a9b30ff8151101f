"""Code lines of the Python files under each folder given: lines that are not blank, comment or docstring lines
(the size the issues budget). Usage: python3 scripts/code_lines.py lookup_decode [benchmarks ...]"""

import ast
import io
import pathlib
import sys
import tokenize

_SKIP = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)


def docstring_lines(src: str) -> set[int]:
    lines = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def code_lines(path: pathlib.Path) -> int:
    src = path.read_text()
    doc = docstring_lines(src)
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in _SKIP:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in doc)
    return len(lines)


def main(folders: list[str]) -> None:
    rows = sorted((code_lines(p), str(p)) for folder in folders for p in pathlib.Path(folder).rglob("*.py"))
    for n, p in rows[-8:]:
        print(f"{n:6d} {p}")
    print(f"{sum(n for n, _ in rows):6d} in all")


if __name__ == "__main__":
    main(sys.argv[1:])
