# Two commands from a fresh clone: `make train` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Without an NVIDIA GPU, pin the CPU build of torch so set-up stays small and fast; with one, let pip
# pick a CUDA build. Elsewhere, add TORCH_INDEX=https://download.pytorch.org/whl/cpu for a CPU-only wheel.
# At least 2.10, as pyproject.toml says: older weights-only loaders can be made to run code (CVE-2025-32434,
# fixed in 2.6.0; CVE-2026-24747, fixed in 2.10.0).
TORCH ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch>=2.10,torch==2.13.0)
TORCH_INDEX ?=
ARGS ?=
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`: whole test files go to one worker each (--dist loadfile), so a file's
# fixtures are made once. Most tests wait on real processes, so 2 workers on 2 cores; 0 runs in one process.
TEST_WORKERS ?= 2
SOAK ?= 3
SOAK_MODULES ?=
SEED ?= 1
TRIALS ?= 200
BUDGET ?= 3600
ONLY ?=
EXAMPLES ?= 1000
# drawn once (`?=` would draw again at each use: the seed printed would not be the seed run)
ifndef FUZZ_SEED
FUZZ_SEED := $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')
endif

.PHONY: train test lint bench soak chaos fuzz mutate clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.torch: | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	touch $@

$(VENV)/.plot: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install -q -e ".[plot]"
	touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install -q -e ".[plot,dev]"
	touch $@

train: $(VENV)/.plot
	$(BIN)/mnist-ddp train --dataset auto $(ARGS)

# ruff; mypy over src/ and benchmarks/ (pyproject.toml's [tool.mypy]): the annotations are checked, not only
# written, and so is each benchmark's use of src's API; and import-linter: each folder of src/mnist_ddp imports only
# the layers below it ([tool.importlinter]).
lint: $(VENV)/.dev
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

# pytest's exit code 5 ("no tests ran") is a failure here, never a silent pass.
test: lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest ran no tests: failing"; exit 1; fi; exit $$rc

# Not part of CI: SOAK rounds of every test module that starts real processes (SOAK_MODULES="faults stops" for a
# subset), each run bounded in time; one summary line, and where the failed runs' output was kept (tests/soak.py).
soak: $(VENV)/.dev
	$(BIN)/python tests/soak.py --rounds $(SOAK) --modules "$(SOAK_MODULES)"

# Not part of CI: TRIALS seeded fault trials (tests/chaos.py), none started after BUDGET seconds; one line per trial,
# a table by fault at the end. ONLY=k replays trial k of SEED alone; FIRST=k starts at trial k (the budget ran
# out). Needs root for namespaces and the full disk.
chaos: $(VENV)/.dev
	$(BIN)/python tests/chaos.py --seed $(SEED) --trials $(TRIALS) --budget $(BUDGET) $(if $(ONLY),--only $(ONLY)) $(if $(FIRST),--first $(FIRST))

# Not part of CI (which runs tests/test_fuzz.py with a fixed seed and a few examples each): EXAMPLES generated inputs
# per property with a new seed (FUZZ_SEED=s repeats one); each input that broke the bad-input contract is printed,
# shrunk, with the seed to replay it. Add it to tests/test_fuzz.py as an @example.
fuzz: $(VENV)/.dev
	FUZZ_EXAMPLES=$(EXAMPLES) $(BIN)/python -m pytest tests/test_fuzz.py -p no:cacheprovider -q --timeout 0 \
		--hypothesis-seed=$(FUZZ_SEED) --hypothesis-show-statistics -k generated; \
	rc=$$?; echo "fuzz: seed $(FUZZ_SEED), $(EXAMPLES) examples per property, pytest exit $$rc"; exit $$rc

# Not part of CI: mutation testing (mutmut) of the modules whose logic is pure, each with its own fast tests
# (tests/mutate.py); a line per module, the surviving mutants, the score. ONLY=a.py,b.py for some.
mutate: $(VENV)/.dev
	$(BIN)/python tests/mutate.py $(if $(ONLY),--only $(ONLY))

bench: $(VENV)/.plot
	$(BIN)/mnist-ddp bench $(ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
