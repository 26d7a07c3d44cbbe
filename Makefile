test:
	pytest

fast:
	pytest -m "not slow"

lint:
	ruff check .
	ruff format --check .

train:
	specrl train

bench:
	specrl bench --out bench
