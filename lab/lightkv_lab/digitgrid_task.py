"""A local lmms-eval task made of held-out DigitGrid episodes, for offline runs of the
``lightkv`` lmms-eval model on the bundled model (tests, docs, CI).

```python
from lightkv_lab.tasks import model as dg_model
from lightkv_lab.digitgrid_task import task_episodes, write_task
model, processor, grid = dg_model.load()
episodes = task_episodes(48, processor, grid)        # images as the processor sees them
write_task("runs/lmms-task", episodes, grid)         # then: --include_path runs/lmms-task
                                                     #       --tasks digitgrid_lightkv
```

The task (``digitgrid_lightkv``) is a ``datasets`` dataset written with ``save_to_disk``
(``dataset_kwargs: {load_from_disk: true}``, so lmms-eval reads it offline), a task YAML and
a ``utils.py`` with its functions: the image, the question's words as the prompt, and
``exact_match`` (the answer's words equal the reference's, as
`lightkv_lab.tasks.evaluate.evaluate` counts) with the question type beside it. Images are
stored as 8-bit PNG; `task_episodes` gives the episodes with exactly the pixels the model's
processor makes of them, so lightkv's own evaluator and lmms-eval see the same inputs.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from lightkv.outputs import write_atomic

__all__ = [
    "CHOICE_TASK",
    "ROUNDS_TASK",
    "TASK_NAME",
    "lmms_eval_command",
    "offline_env",
    "read_run",
    "task_episodes",
    "write_choice_and_rounds_tasks",
    "write_task",
]

TASK_NAME = "digitgrid_lightkv"

UTILS = '''\
"""Functions of the digitgrid_lightkv task (written by lightkv_lab.digitgrid_task)."""


def doc_to_visual(doc):
    return [doc["image"].convert("RGB")]


def doc_to_text(doc):
    return doc["question"]


def process_results(doc, results):
    pred = results[0].strip().split()
    return {"exact_match": float(pred == doc["answer"].split())}
'''

YAML = """\
task: {name}
dataset_path: {data}
dataset_kwargs:
  load_from_disk: true
test_split: test
output_type: generate_until
doc_to_visual: !function utils.doc_to_visual
doc_to_text: !function utils.doc_to_text
doc_to_target: answer
generation_kwargs:
  max_new_tokens: {max_new_tokens}
  do_sample: false
process_results: !function utils.process_results
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 0.0
"""


CHOICE_TASK = "digitgrid_lightkv_choice"
ROUNDS_TASK = "digitgrid_lightkv_rounds"

MORE_UTILS = '''
ANSWERS = {answers!r}


def doc_to_choice(doc):
    return ANSWERS


def doc_to_target(doc):
    return ANSWERS.index(doc["answer"])


def doc_to_round(doc, lmms_eval_specific_kwargs=None, previous_output=None, round_idx=None,
                 previous_round_info=None):
    """Round 0 asks the question, round 1 asks it again; then the conversation ends."""
    if round_idx is None:
        return doc["question"]
    if round_idx == 1:
        return None, doc["question"], False, previous_output, None
    return None, None, True, previous_output, None


def rounds_results(doc, results):
    rounds = results[0]
    return {{"exact_match": float(all(r.split() == doc["answer"].split() for r in rounds))}}
'''

MORE_YAML = """\
task: {name}
dataset_path: {data}
dataset_kwargs:
  load_from_disk: true
test_split: test
doc_to_visual: !function utils.doc_to_visual
"""

CHOICE_YAML = """\
output_type: multiple_choice
doc_to_text: !function utils.doc_to_text
doc_to_choice: !function utils.doc_to_choice
doc_to_target: !function utils.doc_to_target
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 0.0
"""

ROUNDS_YAML = """\
output_type: generate_until_multi_round
doc_to_text: !function utils.doc_to_round
doc_to_target: answer
generation_kwargs:
  max_new_tokens: {max_new_tokens}
  do_sample: false
process_results: !function utils.rounds_results
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 0.0
"""


def write_choice_and_rounds_tasks(directory: str | Path, episodes, grid) -> Path:
    """`write_task`, plus two tasks on the same data: ``digitgrid_lightkv_choice``
    (``multiple_choice`` among every answer of the episodes: lmms-eval's ``loglikelihood``
    requests) and ``digitgrid_lightkv_rounds`` (``generate_until_multi_round``: the question,
    then the same question again; exact when both answers are)."""
    from lightkv_lab.tasks.registry import task_for

    directory = write_task(directory, episodes, grid)
    answers = sorted({" ".join(ep.answer) for ep in episodes})
    write_atomic(directory / "utils.py", UTILS + MORE_UTILS.format(answers=answers))
    data = (directory / "data").resolve()
    max_new = task_for(grid).answer_length(grid) + 2
    for name, body in ((CHOICE_TASK, CHOICE_YAML), (ROUNDS_TASK, ROUNDS_YAML)):
        text = MORE_YAML.format(name=name, data=data) + body.format(max_new_tokens=max_new)
        write_atomic(directory / f"{name}.yaml", text)
    return directory


def task_episodes(n: int, processor, grid, seed: int = 0) -> list:
    """``n`` held-out episodes (`lightkv_lab.tasks.evaluate.heldout_episodes`), each image
    replaced by what ``processor`` makes of its 8-bit PNG (the input lmms-eval gives)."""
    from lightkv_lab.tasks.digitgrid.images import to_pil
    from lightkv_lab.tasks.evaluate import heldout_episodes

    out = []
    for ep in heldout_episodes(n, seed=seed, grid=grid):
        pixels = processor.image_processor(to_pil(ep.image), return_tensors="pt")["pixel_values"][0]
        out.append(replace(ep, image=pixels.float()))
    return out


def write_task(directory: str | Path, episodes, grid, name: str = TASK_NAME) -> Path:
    """Write the task into ``directory`` (the data under ``data/``); returns the directory,
    which lmms-eval's ``--include_path`` takes."""
    import datasets

    from lightkv_lab.tasks.digitgrid.images import to_pil
    from lightkv_lab.tasks.registry import task_for

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rows = {
        "image": [to_pil(ep.image) for ep in episodes],
        "question": [" ".join(ep.question) for ep in episodes],
        "answer": [" ".join(ep.answer) for ep in episodes],
        "qtype": [ep.qtype for ep in episodes],
    }
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "question": datasets.Value("string"),
            "answer": datasets.Value("string"),
            "qtype": datasets.Value("string"),
        }
    )
    data = directory / "data"
    datasets.DatasetDict(
        {"test": datasets.Dataset.from_dict(rows, features=features)}
    ).save_to_disk(str(data))
    write_atomic(directory / "utils.py", UTILS)
    max_new = task_for(grid).answer_length(grid) + 2  # what lightkv's evaluator allows
    write_atomic(
        directory / f"{name}.yaml",
        YAML.format(name=name, data=data.resolve(), max_new_tokens=max_new),
    )
    return directory


def lmms_eval_command(
    task_dir: str | Path,
    out: str | Path,
    model_args: str,
    processes: int = 1,
    batch_size: int = 8,
    port: int = 29500,
    task: str = TASK_NAME,
) -> list[str]:
    """``python -m lmms_eval`` with the ``lightkv`` model on the task in ``task_dir``. With
    ``processes > 1``, started through ``torch.distributed.run``, which is what ``accelerate
    launch --num_processes N`` does on GPUs (``accelerate launch --cpu`` would start one
    process; on the CPU the processes form a gloo group)."""
    args = [
        "-m",
        "lmms_eval",
        "--model",
        "lightkv",
        "--model_args",
        model_args,
        "--tasks",
        task,
        "--include_path",
        str(task_dir),
        "--batch_size",
        str(batch_size),
        "--output_path",
        str(out),
        "--log_samples",
        "--verbosity",
        "WARNING",
    ]
    if processes == 1:
        return [sys.executable, *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(processes),
        "--master_port",
        str(port),
        *args,
    ]


def offline_env() -> dict:
    """The environment for offline runs (no hub, one CPU thread per process)."""
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env.pop("LMMS_EVAL_PLUGINS", None)
    return env


def read_run(out: str | Path, task: str = TASK_NAME, log: str = "") -> tuple[dict, list[dict]]:
    """``(results, samples by doc id)`` of one lmms-eval run written under ``out``; raises
    when there are none (``python -m lmms_eval`` exits 0 even when the evaluation failed)."""
    out = Path(out)
    results = glob.glob(str(out / "**" / "*_results.json"), recursive=True)
    samples = glob.glob(str(out / "**" / f"*_samples_{task}.jsonl"), recursive=True)
    if len(results) != 1 or len(samples) != 1:
        raise RuntimeError(
            f"lmms-eval wrote no single results file under {out}; its output ends:\n{log[-4000:]}"
        )
    rows = [json.loads(line) for line in Path(samples[0]).read_text().splitlines() if line.strip()]
    return json.loads(Path(results[0]).read_text()), sorted(rows, key=lambda r: r["doc_id"])
