"""The Python tool's cost per call: `execute_python("print(1)")` in its sandbox, against the same program run
with the same limits but unisolated, and the bare interpreter start-up both include.

    python benchmarks/python_tool.py [--calls 20]

`interpreter` is `python -I -B -c pass` (site-packages imported, as the tool's program has them);
`unisolated` is sandbox.run(..., isolated=False): the limiter (`python -I -S`, which sets the rlimits and
execs the program) and the program, in a fresh folder on the host; `sandbox` is execute_python: bwrap, its
namespaces and filter, the limiter and the program. The three are timed in turn, call after call, after one
warm-up call each (the sandbox's probe runs in the warm-up), so that a machine whose load drifts moves them
alike; each figure is the median and the mean wall time of `--calls` calls. With an older checkout on
PYTHONPATH only `tool` (its `execute_python(code)`) and `interpreter` are timed. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    from ppokit.environments import python_tool

    def check(answer: str) -> None:
        if answer != "1\n":
            sys.exit(f"the tool answered {answer!r}")

    modes = {"interpreter": lambda: subprocess.run([sys.executable, "-I", "-B", "-c", "pass"], check=True)}
    result = {"benchmark": "python_tool", "calls": args.calls, "source": os.path.dirname(python_tool.__file__)}
    try:
        from ppokit.environments import sandbox
    except ImportError:  # a checkout from before the sandbox
        modes["tool"] = lambda: check(python_tool.execute_python("print(1)"))
    else:
        result["sandbox_problem"] = sandbox.problem()
        argv, files = [sys.executable, "-I", "-B", "main.py"], {"main.py": b"print(1)\n"}
        modes["unisolated"] = lambda: check(sandbox.run(argv, sandbox.Limits(), files, isolated=False).stdout.decode())
        if sandbox.problem() is None:
            modes["sandbox"] = lambda: check(python_tool.execute_python("print(1)"))
    seconds: dict[str, list[float]] = {name: [] for name in modes}
    for fn in modes.values():
        fn()
    for _ in range(args.calls):
        for name, fn in modes.items():
            started = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - started)
    for name, times in seconds.items():
        result[name] = {"median_ms": round(1000 * statistics.median(times), 1), "mean_ms": round(1000 * statistics.fmean(times), 1)}
    result["load_avg"] = [round(x, 1) for x in os.getloadavg()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
