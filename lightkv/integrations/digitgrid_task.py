"""A local lmms-eval task made of held-out DigitGrid episodes, for offline runs of the
``lightkv`` lmms-eval model on the bundled model (tests, docs, CI).

```python
from lightkv.digitgrid import model as dg_model
from lightkv.integrations.digitgrid_task import task_episodes, write_task
model, processor, grid = dg_model.load()
episodes = task_episodes(48, processor, grid)        # images as the processor sees them
write_task("runs/lmms-task", episodes, grid)         # then: --include_path runs/lmms-task
                                                     #       --tasks digitgrid_lightkv
```

The task (``digitgrid_lightkv``) is a ``datasets`` dataset written with ``save_to_disk``
(``dataset_kwargs: {load_from_disk: true}``, so lmms-eval reads it offline), a task YAML and
a ``utils.py`` with its functions: the image, the question's words as the prompt, and
``exact_match`` (the answer's words equal the reference's, as
`lightkv.digitgrid.evaluate.evaluate` counts) with the question type beside it. Images are
stored as 8-bit PNG; `task_episodes` gives the episodes with exactly the pixels the model's
processor makes of them, so lightkv's own evaluator and lmms-eval see the same inputs.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

__all__ = ["TASK_NAME", "task_episodes", "write_task"]

TASK_NAME = "digitgrid_lightkv"

UTILS = '''\
"""Functions of the digitgrid_lightkv task (written by lightkv.integrations.digitgrid_task)."""


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


def task_episodes(n: int, processor, grid, seed: int = 0) -> list:
    """``n`` held-out episodes (`lightkv.digitgrid.evaluate.heldout_episodes`), each image
    replaced by what ``processor`` makes of its 8-bit PNG (the input lmms-eval gives)."""
    from ..digitgrid.evaluate import heldout_episodes
    from ..digitgrid.images import to_pil

    out = []
    for ep in heldout_episodes(n, seed=seed, grid=grid):
        pixels = processor.image_processor(to_pil(ep.image), return_tensors="pt")["pixel_values"][0]
        out.append(replace(ep, image=pixels.float()))
    return out


def write_task(directory: str | Path, episodes, grid, name: str = TASK_NAME) -> Path:
    """Write the task into ``directory`` (the data under ``data/``); returns the directory,
    which lmms-eval's ``--include_path`` takes."""
    import datasets

    from ..digitgrid.images import to_pil
    from ..digitgrid.tasks import task_for

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rows = {"image": [to_pil(ep.image) for ep in episodes],
            "question": [" ".join(ep.question) for ep in episodes],
            "answer": [" ".join(ep.answer) for ep in episodes],
            "qtype": [ep.qtype for ep in episodes]}
    features = datasets.Features({"image": datasets.Image(), "question": datasets.Value("string"),
                                  "answer": datasets.Value("string"), "qtype": datasets.Value("string")})
    data = directory / "data"
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(rows, features=features)}).save_to_disk(str(data))
    (directory / "utils.py").write_text(UTILS)
    max_new = task_for(grid).answer_length(grid) + 2  # what lightkv's evaluator allows
    (directory / f"{name}.yaml").write_text(YAML.format(name=name, data=data.resolve(), max_new_tokens=max_new))
    return directory
