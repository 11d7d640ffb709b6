"""The laboratory's commands of the ``lightkv`` command line, registered in the entry-point
group ``lightkv.commands`` (see `lightkv.lab`): ``lightkv bench ...`` (`lightkv_lab.cli.bench`),
``lightkv demo`` and ``lightkv stages-demo`` (`lightkv_lab.cli.demos`)."""
