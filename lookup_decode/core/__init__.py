"""The algorithm, with no engine in it: drafts and the drafter contract, the suffix index, the decoding
step, acceptance rules, the draft-length policy, forward costs, statistics and options.

Nothing here imports transformers or vLLM; engines (`lookup_decode.engines`) translate their own view
into these types and back.
"""
