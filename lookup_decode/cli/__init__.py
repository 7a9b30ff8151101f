"""The `lookup-decode` commands (`commands.main`): generate, chat (`chat`), bench (`bench`), run (the batch
job, `engines.batch`)."""


def check_at_least(prog: str, args, **minimums) -> None:
    """SystemExit naming the first flag below its minimum, in the order given (a flag left at None is not checked)."""
    for name, low in minimums.items():
        value = getattr(args, name)
        if value is not None and not value >= low:
            raise SystemExit(f"{prog}: --{name.replace('_', '-')} must be >= {low}, got {value}")
