"""Where results go, and the one function that writes one: DIR/NAME.json, DIR/NAME.md and the command line.

Every study keeps its numbers next to the command that made them: the JSON holds the environment (versions,
hardware, `command`) as `lookup_decode.measure.environment` records it, or at least the command line.
"""

from __future__ import annotations

import json
from pathlib import Path

from lookup_decode.measure import command_line

RESULTS = Path(__file__).resolve().parents[1] / "results"     # benchmarks/results: one folder per study


def write_result(folder, name: str, result: dict, markdown: str | None = None, *, echo: bool = True,
                 default=None) -> Path:
    """Write `result` to FOLDER/NAME.json (making the folder) and `markdown` to FOLDER/NAME.md; print the markdown
    (echo). A result that names no command (neither `command` nor `environment["command"]`) gets the running
    command line as `command`. default: json.dumps' hook for values JSON has no type for. Returns the JSON's path.

    Studies that write as they go (a run cut short keeps what it measured) call it with markdown=None after every
    unit of work and once more with the tables at the end.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if not (result.get("command") or (result.get("environment") or {}).get("command")):
        result["command"] = command_line()
    path = folder / f"{name}.json"
    path.write_text(json.dumps(result, indent=1, default=default))
    if markdown is not None:
        (folder / f"{name}.md").write_text(markdown)
        if echo:
            print(markdown)
    return path
