"""Serving a draft in SGLang and vLLM: the engines' flags and tables, shell quoting, vocabulary surgery."""
