"""The memory child process: ``python -m lightkv_lab.bench.efficiency --memory-child -`` (the JSON
job on stdin, or inline in place of ``-``)
(started by `lightkv_lab.bench.efficiency.measure.measure_peaks_in_child`)."""

import sys

from lightkv_lab.bench.efficiency.measure import memory_child_main

if len(sys.argv) == 3 and sys.argv[1] == "--memory-child":
    raise SystemExit(memory_child_main(sys.argv[2]))
raise SystemExit("use `lightkv bench efficiency` or benchmarks/efficiency.py")
