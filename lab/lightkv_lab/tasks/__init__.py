"""The synthetic LVLM tasks and what they share: one model builder, trainer, evaluation,
scoring and demo, and one subpackage per task's data.

| task | package | its tokens | what it can show |
|---|---|---|---|
| Scenes-VQA (default) | `lightkv_lab.tasks.scenes` | mostly redundant (ground, large objects), details in single tokens | methods near-lossless at half the tokens, separating at low budgets |
| DigitGrid-VQA | `lightkv_lab.tasks.digitgrid` | every token of a cell identical | the saturated end: every merging method passes |
| SymbolGrid-VQA | `lightkv_lab.tasks.symbolgrid` | neighbours never repeat | the adversarial end: every prefill method fails |

Shared modules: `registry` (`Task`, `get_task`), `model` (build, save, load, the bundled
models), `batching`, `train` (``python -m lightkv_lab.tasks.train``), `evaluate`, `scoring`,
`circuit` (SymbolGrid's initialisation) and `demo` (``lightkv demo``).
"""

from lightkv_lab.tasks.registry import TASKS, Task, get_task, task_for

__all__ = ["TASKS", "Task", "get_task", "task_for"]
