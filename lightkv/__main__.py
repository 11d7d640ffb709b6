"""``python -m lightkv``: the same as the ``lightkv`` command."""

import sys

from .cli import main

sys.exit(main())
