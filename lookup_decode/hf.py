"""The documented path of the transformers hook (`lookup_decode.hf.lookup_decoding`); it lives in
`lookup_decode.engines.hf`."""

from lookup_decode.engines.hf.hook import generate, lookup_decoding  # noqa: F401
