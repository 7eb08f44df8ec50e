"""Text in and out: tokenizer, incremental detokenizer, stop strings, per-request text, chat."""
