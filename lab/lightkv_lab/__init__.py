"""The lightkv laboratory: bundled tasks and tiny models, their trainer, benchmarks, demos
and figures, in a distribution of its own (``lightkv-lab``) over the library ``lightkv``.

Its packages: `lightkv_lab.tasks` (data, models, trainer, evaluation), `lightkv_lab.bench`
(quality and efficiency benchmarks), `lightkv_lab.demos` and `lightkv_lab.stages_demo`,
`lightkv_lab.vis` (pictures), `lightkv_lab.cli` (the ``lightkv`` subcommands it adds) and
`lightkv_lab.models` (the bundled models ``lightkv generate --model NAME`` finds).
"""

__version__ = "0.1.0"
