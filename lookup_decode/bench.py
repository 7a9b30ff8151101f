"""`lookup-decode bench`: measure lookup decoding on the user's own requests (placeholder, being built)."""


def add_arguments(parser) -> None:
    parser.add_argument("--prompts", required=True, help="JSONL file or folder of .txt files")


def run(args) -> int:
    raise SystemExit("lookup-decode bench: not implemented yet")
