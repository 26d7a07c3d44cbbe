test:
	pytest
	pytest -m ray

fast:
	pytest -m "not slow and not ray and not realmodel"

lint:
	ruff check .
	ruff format --check .

train:
	specrl train

bench:
	specrl bench --out bench
