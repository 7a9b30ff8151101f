"""What drafts come from besides the request itself: corpora shared across requests (session memory,
reference documents), the multi-source drafter that picks the longest match, and tree drafts."""
