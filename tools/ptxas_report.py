"""Registers, stack frame, spills and shared memory of each kernel in raw_kernels/, as ptxas reports them.

NVRTC compiles the family with the engine's options and `--ptxas-options=-v`, on this machine: no GPU is
needed. Read it before spending device time on a kernel change: a per-thread array that ptxas could not
keep in registers shows as a stack frame (PERF_NOTES 40(b): a tile kernel's 16-byte packs in local memory,
at 60% of the copy where its one-vector sibling ran at 96%), and the registers bound the blocks per SM.

    python tools/ptxas_report.py activations --match quant_tp
    python tools/ptxas_report.py --stack        # every kernel with a stack frame or spills
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuengine.kernels._build import compile_cubin, kernel_dir, kernel_files  # noqa: E402

_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_PROPS = re.compile(r"Function properties for (\w+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?, (\d+) bytes smem)?")


def parse_log(log: str) -> list[dict]:
    """One record per kernel of a ptxas -v log: kernel, registers, stack, spill_stores, spill_loads, smem."""
    kernels, current, props_of = [], None, None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = {"kernel": m.group(1), "registers": 0, "stack": 0, "spill_stores": 0, "spill_loads": 0,
                       "smem": 0}  # fmt: skip
            kernels.append(current)
        elif m := _PROPS.search(line):  # a called (not inlined) device function's frame is not the kernel's
            props_of = m.group(1)
        elif current is not None and props_of == current["kernel"] and (m := _FRAME.search(line)):
            current["stack"], current["spill_stores"], current["spill_loads"] = map(int, m.groups())
        elif current is not None and (m := _USED.search(line)):
            current["registers"], current["smem"] = int(m.group(1)), int(m.group(2) or 0)
    return kernels


def report(path: Path, arch: str = "sm_90a") -> list[dict]:
    """parse_log of raw_kernels/<family>.cu compiled for `arch`."""
    _, log = compile_cubin(path, arch, ("--ptxas-options=-v",))
    return parse_log(log)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("families", nargs="*", help="raw_kernels/<family>.cu names (default: every family)")
    ap.add_argument("--match", default="", help="only kernels whose name contains this")
    ap.add_argument("--stack", action="store_true", help="only kernels with a stack frame or spills")
    ap.add_argument("--arch", default="sm_90a")
    args = ap.parse_args(argv)
    paths = [kernel_dir() / f"{f}.cu" for f in args.families] if args.families else kernel_files()
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        ap.error(f"no such kernel family: {', '.join(missing)}")
    print(f"{'kernel':<60}{'regs':>6}{'stack B':>9}{'spill st':>9}{'spill ld':>9}{'smem B':>8}")
    for path in paths:
        for k in report(path, args.arch):
            if args.match not in k["kernel"] or (args.stack and not (k["stack"] or k["spill_stores"])):
                continue
            print(f"{k['kernel']:<60}{k['registers']:>6}{k['stack']:>9}{k['spill_stores']:>9}{k['spill_loads']:>9}"
                  f"{k['smem']:>8}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
