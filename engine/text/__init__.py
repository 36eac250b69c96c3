"""Text in and out: the tokenizer with its chat template, the incremental detokenizer, structured-output
grammars (llguidance), tool-call formats and parsers, and tool-use planning over chat templates."""
