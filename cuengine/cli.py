"""The `cuengine` command line."""

from __future__ import annotations

import argparse
import sys


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for pkg in ("cuengine", "numpy", "ml-dtypes", "safetensors", "cupy-cuda13x", "nvmath-python", "cuda-bindings",
                "nvidia-cudnn-frontend"):  # fmt: skip
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def cmd_info(args) -> int:
    import cuengine as ce

    dev = ce.device(args.device)
    print(f"device: {dev.kind} - {dev.name}")
    if dev.is_cuda:
        print(f"compute capability: {dev.compute_capability[0]}.{dev.compute_capability[1]}, SMs: {dev.num_sms}")
    free, total = dev.memory_info()
    print(f"memory: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB")
    for pkg, ver in _versions().items():
        print(f"{pkg}: {ver}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cuengine", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="print the device, library versions and memory")
    info.add_argument("--device", default="auto")
    info.set_defaults(fn=cmd_info)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
