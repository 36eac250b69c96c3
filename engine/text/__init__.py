"""Text in and out: the tokenizer with its chat template, the incremental detokenizer, structured-output
grammars (llguidance), tool-call formats and parsers, tool-use planning over chat templates, and a
score request's token ids (lm-evaluation-harness's context/continuation split)."""
