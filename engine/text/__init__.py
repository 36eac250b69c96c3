"""Text in and out: the tokenizer with its chat template, the incremental detokenizer, and a score
request's token ids (lm-evaluation-harness's context/continuation split)."""
