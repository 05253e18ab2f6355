"""``fd-cudagraph`` (also ``python -m fd_cudagraph_plugin``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from fd_cudagraph_plugin.core.errors import ConfigError, CudaGraphPluginError
from fd_cudagraph_plugin.tools.capture_rules import SPEC_METHODS, SPLITWISE_ROLES

DESCRIPTION = (
    "fd-cudagraph (also python -m fd_cudagraph_plugin): plan, tune and check the CUDA-graph "
    "backend that fd-cudagraph-plugin puts into FastDeploy."
)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1; got {value}")
    return value


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
    from fd_cudagraph_plugin.tools.demo import format_report, run_demo

    # The demo prints the capture summary and the stats table itself; keep warnings only.
    logging.getLogger("fd_cudagraph_plugin").setLevel(logging.WARNING)

    report = run_demo(sizes=args.sizes, steps=args.steps, seed=args.seed, runtime_name=args.runtime)
    print(format_report(report))
    return 0 if report.mismatches == 0 else 1


def _json(document: dict) -> str:
    """Valid JSON with one top-level key per line, each value compact (maps run to 512 keys)."""
    rows = [f"  {json.dumps(key)}: {json.dumps(value)}" for key, value in document.items()]
    return "{\n" + ",\n".join(rows) + "\n}"


def _cmd_plan(args: argparse.Namespace) -> int:
    from fd_cudagraph_plugin.tools.plan import PlanInput, derive_plan, format_plan

    plan = derive_plan(
        PlanInput(
            max_num_seqs=args.max_num_seqs,
            num_speculative_tokens=args.num_speculative_tokens,
            spec_method=args.spec_method,
            tensor_parallel_size=args.tensor_parallel_size,
            sequence_parallel_moe=args.sequence_parallel_moe,
            graph_opt_level=args.graph_opt_level,
            full_cuda_graph=args.full_cuda_graph,
            max_capture_shape_prefill=args.max_capture_shape_prefill,
            only_prefill=args.only_prefill,
            capture_sizes=tuple(args.capture_sizes) if args.capture_sizes else None,
            capture_sizes_prefill=(
                tuple(args.capture_sizes_prefill) if args.capture_sizes_prefill else None
            ),
            splitwise_role=args.splitwise_role,
            draft_model_use_cudagraph=args.draft_model_use_cudagraph,
        )
    )
    print(_json(plan.to_json()) if args.json else format_plan(plan))
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    from fd_cudagraph_plugin.tools.traces import read_histogram
    from fd_cudagraph_plugin.tools.tune import format_result, tune

    if args.trace.count("-") > 1:
        raise ConfigError("standard input (-) can be given once among the trace files.")
    result = tune(
        read_histogram(args.trace), args.max_graphs, args.max_size, args.num_speculative_tokens
    )
    print(_json(result.to_json()) if args.json else format_result(result))
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from fd_cudagraph_plugin.tools.doctor import exit_code, format_results, run_checks

    results = run_checks()
    if args.json:
        document = {
            "checks": [
                {"name": r.name, "status": r.status, "detail": r.detail, "fix": r.fix}
                for r in results
            ],
            "exit_code": exit_code(results),
        }
        print(json.dumps(document, indent=2))
    else:
        print(format_results(results))
    return exit_code(results)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan",
        help="print the capture sizes and padding maps FastDeploy derives for these settings",
        description="The capture sizes, padding maps and graphs per backend that FastDeploy "
        "derives for these serving settings (its GraphOptimizationConfig rules).",
    )
    plan.add_argument(
        "--max-num-seqs", type=int, default=8, help="default 8, FastDeploy's CLI default"
    )
    plan.add_argument("--spec-method", choices=SPEC_METHODS, default=None)
    plan.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="draft tokens k (default 1 with --spec-method, FastDeploy's default)",
    )
    plan.add_argument("--tensor-parallel-size", type=int, default=1)
    plan.add_argument(
        "--sequence-parallel-moe",
        action="store_true",
        help="use_sequence_parallel_moe: keeps decode sizes divisible by TP",
    )
    plan.add_argument("--graph-opt-level", type=int, choices=(0, 1, 2), default=0)
    plan.add_argument(
        "--full-cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="full_cuda_graph (default true); --no-full-cuda-graph with level >= 1 is static split",
    )
    plan.add_argument("--max-capture-shape-prefill", type=int, default=512)
    plan.add_argument("--only-prefill", action="store_true", help="cudagraph_only_prefill")
    plan.add_argument(
        "--capture-sizes", type=_sizes, default=None, help="cudagraph_capture_sizes, e.g. 1,2,4,8"
    )
    plan.add_argument(
        "--capture-sizes-prefill",
        type=_sizes,
        default=None,
        help="cudagraph_capture_sizes_prefill (static split)",
    )
    plan.add_argument(
        "--splitwise-role",
        choices=SPLITWISE_ROLES,
        default="mixed",
        help="FastDeploy's splitwise_role (default mixed, as FastDeploy's)",
    )
    plan.add_argument(
        "--draft-model-use-cudagraph",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="draft_model_use_cudagraph for MTP (default true as in develop; 2.6 defaults false)",
    )
    plan.add_argument("--json", action="store_true", help="print JSON")
    plan.set_defaults(run=_cmd_plan)


def _add_tune(sub: argparse._SubParsersAction) -> None:
    tune = sub.add_parser(
        "tune",
        help="choose the capture sizes that pad a recorded decode trace least",
        description="Choose at most N capture sizes with the fewest padded tokens over a decode "
        "trace (exact), and compare with FastDeploy's default list.",
    )
    tune.add_argument(
        "trace",
        nargs="+",
        help="one decode token count per line, or the plugin's fd-cudagraph-stats/1 JSON "
        "lines; - reads standard input",
    )
    tune.add_argument("--max-graphs", type=int, required=True, help="at most this many sizes")
    tune.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="k of MTP/ngram/suffix decoding: read a plain trace as running requests per step "
        "and fit the sizes FastDeploy multiplies by k + 1 (stats files say k themselves)",
    )
    tune.add_argument(
        "--max-size",
        type=int,
        default=None,
        help="largest capture size (default: largest observed count); steps above it run "
        "eagerly and are left out",
    )
    tune.add_argument("--json", action="store_true", help="print JSON")
    tune.set_defaults(run=_cmd_tune)


def build_parser() -> argparse.ArgumentParser:
    from fd_cudagraph_plugin import __version__

    parser = argparse.ArgumentParser(prog="fd-cudagraph", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"fd-cudagraph {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="capture and serve a small model through the backend")
    demo.add_argument("--sizes", type=_sizes, default=None, help="capture sizes, e.g. 1,2,4,8")
    demo.add_argument(
        "--steps", type=_positive, default=200, help="decode steps to serve (default 200)"
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--runtime",
        choices=("cuda", "simulated"),
        default=None,
        help="default: cuda when Paddle has CUDA, else simulated (said in the output)",
    )
    demo.set_defaults(run=_cmd_demo)

    _add_plan(sub)
    _add_tune(sub)
    doctor = sub.add_parser(
        "doctor", help="check that FastDeploy will load and use the plugin here, with fixes"
    )
    doctor.add_argument("--json", action="store_true", help="print JSON")
    doctor.set_defaults(run=_cmd_doctor)
    return parser


def _drop_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout replaced (pytest) or already closed
        pass


def main(argv: list[str] | None = None) -> int:
    """Run one command; exit 2 on bad input, 130 on Ctrl-C, 1 when stdout cannot be written."""
    try:
        args = build_parser().parse_args(argv)
        try:
            code = args.run(args)
        except CudaGraphPluginError as error:
            print(f"fd-cudagraph: {error}", file=sys.stderr)
            return 2
        # A full disk or a closed pipe shows up at the flush; make it happen here, inside the
        # handlers, not at interpreter exit.
        sys.stdout.flush()
        return code
    except KeyboardInterrupt:
        print("fd-cudagraph: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _drop_stdout()
        return 1
    except OSError as error:
        _drop_stdout()
        print(f"fd-cudagraph: cannot write the output: {error.strerror or error}", file=sys.stderr)
        return 1
