"""``fd-cudagraph`` (also ``python -m fd_cudagraph_plugin``)."""

from __future__ import annotations

import argparse
import logging
import sys

from fd_cudagraph_plugin.errors import CudaGraphPluginError


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"sizes must be comma-separated integers; got {text!r}"
        ) from None
    if not sizes or min(sizes) <= 0:
        raise argparse.ArgumentTypeError(f"sizes must be positive integers; got {text!r}")
    return sizes


def _cmd_demo(args: argparse.Namespace) -> int:
    try:
        import paddle  # noqa: F401
    except ImportError:
        print(
            "fd-cudagraph demo needs Paddle. On a fresh machine: "
            "pip install 'fd-cudagraph-plugin[demo]' (CPU Paddle); on a GPU machine keep your "
            "paddlepaddle-gpu.",
            file=sys.stderr,
        )
        return 2
    from fd_cudagraph_plugin.demo import format_report, run_demo

    # The demo prints the capture summary and the stats table itself; keep warnings only.
    logging.getLogger("fd_cudagraph_plugin").setLevel(logging.WARNING)

    report = run_demo(sizes=args.sizes, steps=args.steps, seed=args.seed, runtime_name=args.runtime)
    print(format_report(report))
    return 0 if report.mismatches == 0 else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fd-cudagraph", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="capture and serve a small model through the backend")
    demo.add_argument("--sizes", type=_sizes, default=None, help="capture sizes, e.g. 1,2,4,8")
    demo.add_argument("--steps", type=int, default=200, help="decode steps to serve (default 200)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--runtime",
        choices=("cuda", "simulated"),
        default=None,
        help="default: cuda when Paddle has CUDA, else simulated (said in the output)",
    )
    demo.set_defaults(run=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except CudaGraphPluginError as error:
        print(f"fd-cudagraph: {error}", file=sys.stderr)
        return 2
