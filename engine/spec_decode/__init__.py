"""Speculative decoding: proposers guess the next tokens, the target model verifies them.

``config.py`` (``--speculative-config``), ``ngram.py`` (prompt lookup), ``draft_model.py`` (a
smaller model with its own KV cache), ``verify.py`` (which guesses the target accepts, exactly).
"""

from engine.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
