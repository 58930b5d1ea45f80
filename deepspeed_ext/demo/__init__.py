"""The built-in demo: train a tiny Llama at TP=2, convert, resume at TP=1/3/4 (see README)."""
