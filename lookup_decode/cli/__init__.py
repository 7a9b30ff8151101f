"""The `lookup-decode` commands (`commands.main`): generate, chat (`chat`), bench (`bench`), run (the batch
job, `engines.batch`)."""

from contextlib import contextmanager


def check_at_least(prog: str, args, **minimums) -> None:
    """SystemExit naming the first flag below its minimum, in the order given (a flag left at None is not checked)."""
    for name, low in minimums.items():
        value = getattr(args, name)
        if value is not None and not value >= low:
            raise SystemExit(f"{prog}: --{name.replace('_', '-')} must be >= {low}, got {value}")


@contextmanager
def exits_on(*errors, prefix: str = "lookup-decode"):
    """An error of these types in the block ends the command with its message: SystemExit("prefix: message")."""
    try:
        yield
    except errors as e:
        raise SystemExit(f"{prefix}: {e}") from None
