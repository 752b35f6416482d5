.PHONY: setup demo test
setup:
	./scripts/setup.sh
demo: setup
	.venv/bin/dsparkctl generate --max-new-tokens 64 --policy static:2 --baseline --repeats 3 "Write a haiku about speculative decoding."
test: setup
	.venv/bin/python -m pytest
