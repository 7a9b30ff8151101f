"""The transformers engine: the `generate` hook (`hook`), the forwards that verify drafts with a transformers
model (`forward`), cache rollback (`cache`), encoder-decoder specifics (`encdec`), stopping criteria
(`stopping`), draft models (`draft_model`) and model loading (`models`)."""
