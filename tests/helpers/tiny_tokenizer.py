"""The tiny offline tokenizer, which lives in the package so that ``prefixroute tokenizer
--tiny`` and the suites make the same one (:mod:`prefixroute.edges.tiny_tokenizer`)."""

from prefixroute.edges.tiny_tokenizer import (CHAT_TEMPLATE, SPECIAL_TOKENS, TOOLS_CHAT_TEMPLATE,
                                              VOCAB_SIZE, copy_with_template, make_tiny_tokenizer,
                                              write_tokenizer_config)

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "TOOLS_CHAT_TEMPLATE", "VOCAB_SIZE",
           "copy_with_template", "make_tiny_tokenizer", "write_tokenizer_config"]
