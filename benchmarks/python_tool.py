"""The Python tool's cost per call: `execute_python("print(1)")` in its sandbox, against the same program run
with the same limits but unisolated, and the bare interpreter start-up it includes.

    python benchmarks/python_tool.py [--calls 20]

Each figure is the median and the mean wall time of `--calls` sequential calls after one warm-up call (the
sandbox's probe runs in the warm-up). `interpreter` is `python -I -B -c pass` (site-packages imported, as the
tool's program has them); `sandbox` adds bwrap, the limiter's `python -I -S` and the namespaces. Run with an
older checkout on PYTHONPATH to time its tool (only `execute_python(code)` is called there).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import time


def timed(fn, calls: int) -> dict:
    fn()
    seconds = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - started)
    return {"median_ms": round(1000 * statistics.median(seconds), 1), "mean_ms": round(1000 * statistics.fmean(seconds), 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    from ppokit.environments import python_tool

    def sandboxed():
        assert python_tool.execute_python("print(1)") == "1\n"

    result = {"benchmark": "python_tool", "calls": args.calls, "source": os.path.dirname(python_tool.__file__)}
    result["interpreter"] = timed(lambda: subprocess.run([sys.executable, "-I", "-B", "-c", "pass"], check=True), args.calls)
    if "unsafe_without_isolation" in inspect.signature(python_tool.execute_python).parameters:
        from ppokit.environments import sandbox

        result["sandbox_problem"] = sandbox.problem()
        result["unisolated"] = timed(lambda: python_tool.execute_python("print(1)", unsafe_without_isolation=True) == "1\n" or sys.exit(1),
                                     args.calls)
        if sandbox.problem() is None:
            result["sandbox"] = timed(sandboxed, args.calls)
    else:
        result["tool"] = timed(sandboxed, args.calls)
    result["load_avg"] = [round(x, 1) for x in os.getloadavg()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
