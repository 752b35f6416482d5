.PHONY: setup demo test test-fast
setup:
	./scripts/setup.sh
demo: setup
	.venv/bin/dsparkctl generate --dataset mt-bench --limit 4 --batch-size 1 --max-new-tokens 64 --baseline --repeats 3
test: setup
	.venv/bin/python -m pytest
test-fast: setup
	.venv/bin/python -m pytest -m "not slow"
