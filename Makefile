# make setup   create .venv with the pinned environment (once; again when pyproject.toml changes)
# make course  run every notebook headless, in order, into build/notebooks
# make test    pytest: package, scripts under torchrun, notebook sync, nbval (two passes)
# make lab     JupyterLab at the repository root (terminals there, .venv/bin first on PATH)
# make site    the executed notebooks as a website in build/site (nothing is re-run)
# make slurm-test  scripts/11_train.sbatch on a one-node Slurm started here (root; apt-get),
#                  then lesson 11, whose Slurm job trains, is requeued and resumes
# make gpu-check   on a GPU machine: A the GPU tests (tests/gpu/), B the notebooks with a CUDA path at
#                  this GPU count, cheapest first, one at a time, each only if its estimate fits the
#                  budget (9 min + 1 to stop: 10 min with 1-3 GPUs; 4 GPUs default to 30), C the rest
#                  listed as skipped; a summary in benchmarks/gpu-<GPU name>/ and a table; exit 0 all
#                  of A and B ran and passed, 1 a failure, 2 no GPU, 3 not all of A and B ran.
#                  Options go in ARGS: make gpu-check ARGS="--budget-s 1200 --all"
# make gpu-check-plan  the plan, order and estimated time with 1, 2 and 4 GPUs; runs nothing, needs
#                  no GPU (ARGS="--gpus 2" for one count)
# make test TORCH=2.15.0  the same suite against another torch, in its own .venv-torch-2.15.0:
#                  that torch, the newest torchvision of the supported range that admits it,
#                  every other package as pinned. If pip refuses the version ("The user requested
#                  (constraint) torch<=..."), its configuration caps torch: add
#                  PIP_CONFIG_FILE=/dev/null, which makes pip read no configuration file.
PYTHON ?= python3
ifdef TORCH
VENV ?= .venv-torch-$(TORCH)
else
VENV ?= .venv
endif
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup course test lab lint site slurm-test gpu-check gpu-check-plan

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
ifdef TORCH
	$(PYTHON) ddp_course/harness/pins.py > $(VENV)/pins.txt
	$(PY) -m pip install --quiet "torch==$(TORCH)" -r $(VENV)/pins.txt -e ".[dev]"
else
	$(PY) -m pip install --quiet -e ".[pinned,dev]"
endif
	$(PY) -m ddp_course check
	touch $(STAMP)

setup: $(STAMP)

course: $(STAMP)
	$(PY) -m ddp_course course

# Two passes, both always run: the tests that mostly wait (timeouts, servers,
# start-up) on two workers, then the notebooks and timing-sensitive tests alone.
test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile -m "not serial"; parallel=$$?; \
	$(PY) -m pytest -m serial; serial=$$?; \
	test $$parallel -eq 0 -a $$serial -eq 0

lint: $(STAMP)
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

lab: $(STAMP)
	$(PY) -m ddp_course lab

site: $(STAMP)
	$(PY) docs/build_site.py --out build/site

slurm-test: $(STAMP)
	$(PY) -m pytest tests/harness/test_slurm.py notebooks/11_multinode.ipynb -v -ra

gpu-check: $(STAMP)
	$(PY) -m ddp_course gpu-check $(ARGS)

gpu-check-plan: $(STAMP)
	$(PY) -m ddp_course gpu-check --dry-run $(ARGS)
