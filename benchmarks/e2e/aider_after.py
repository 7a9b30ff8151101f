"""The after-file of an Aider refactor task, made mechanically: the output a capable model writes.

The Aider refactor benchmark has no reference output (it checks answers with AST tests), but its
task is mechanical: "Refactor the `m` method in the `C` class to be a stand alone, top level
function ... Update any existing `self.m` calls". In Aider's whole-file edit format a correct answer
re-emits the file with that one change, so doing the move with `ast` gives a faithful stand-in for a
large model's output to replay (the scaling study uses it for contexts the default model cannot hold).

The move: the method's lines (decorators included) leave the class, are dedented to top level
(lines less indented than the method, inside multi-line strings, stay as they are),
lose `self` as first parameter (and a @staticmethod/@classmethod decorator), and are inserted two
blank lines after the class; every `self.m(` in the file becomes `m(`.
"""

from __future__ import annotations

import ast
import re

_TASK = re.compile(r"Refactor the `(?P<method>\w+)` method in the `(?P<cls>\w+)` class")


def parse_task(instruction: str) -> tuple[str, str]:
    """(class name, method name) named by an Aider refactor instruction; ValueError if it names none."""
    m = _TASK.search(instruction)
    if m is None:
        raise ValueError(f"not an Aider refactor instruction: {instruction[:80]!r}")
    return m["cls"], m["method"]


def move_method_to_top_level(source: str, class_name: str, method_name: str) -> str:
    """`source` with method `class_name.method_name` moved out of its class (see the module docstring).

    Raises ValueError when the class or the method is not found.
    """
    tree = ast.parse(source)
    cls = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if cls is None:
        raise ValueError(f"class {class_name!r} not found")
    fn = next((n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
               and n.name == method_name), None)
    if fn is None:
        raise ValueError(f"method {method_name!r} not found in class {class_name!r}")
    lines = source.splitlines(keepends=True)
    first = min([fn.lineno] + [d.lineno for d in fn.decorator_list]) - 1   # 0-based, decorators included
    last = fn.end_lineno                                                     # exclusive
    # Dedent by the method's own indentation (not textwrap.dedent: a multi-line string at column 0
    # inside the method would make its common indentation empty).
    pad = " " * fn.col_offset
    method = "".join(line[len(pad):] if line.startswith(pad) else line for line in lines[first:last])
    method = re.sub(r"^@(staticmethod|classmethod)\s*\n", "", method, flags=re.M)
    method = re.sub(rf"(def {method_name}\()\s*(self|cls)\s*(,\s*|\))",
                    lambda m: m[1] + ("" if m[3].startswith(",") else ")"), method, count=1)
    rest = lines[:first] + lines[last:]
    # Insert after the top-level statement that holds the class (the class itself unless nested).
    top = next(n for n in tree.body if n.lineno <= cls.lineno and n.end_lineno >= cls.end_lineno)
    insert_at = top.end_lineno - (last - first)           # its end once the method's lines are gone
    if len(cls.body) == 1:                                # the class would be empty
        rest.insert(first, " " * fn.col_offset + "pass\n")
        insert_at += 1
    moved = ["\n", "\n"] + [method if method.endswith("\n") else method + "\n"]
    after = "".join(rest[:insert_at] + moved + rest[insert_at:])
    return re.sub(rf"\bself\.{method_name}\(", f"{method_name}(", after)
