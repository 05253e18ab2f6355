"""``fd-cudagraph`` (also ``python -m fd_cudagraph_plugin``)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, NoReturn

from fd_cudagraph_plugin.core.errors import ConfigError, CudaGraphPluginError
from fd_cudagraph_plugin.tools.capture_rules import (
    DECODE_CAP,
    MAX_PREFILL_SHAPE,
    MAX_SPECULATIVE_TOKENS,
    MAX_TENSOR_PARALLEL_SIZE,
    RELEASES,
    RULES,
    SPEC_METHODS,
    SPLITWISE_ROLES,
)
from fd_cudagraph_plugin.tools.demo import (
    DEFAULT_SIZES,
    DEMO_MAX_SEED,
    DEMO_MAX_SIZE,
    DEMO_MAX_STEPS,
    DEMO_SIZE_BOUND,
)
from fd_cudagraph_plugin.tools.traces import TOKEN_LIMIT
from fd_cudagraph_plugin.tools.wording import shown

DESCRIPTION = (
    "fd-cudagraph (also python -m fd_cudagraph_plugin): plan, tune and check the CUDA-graph "
    "backend that fd-cudagraph-plugin puts into FastDeploy."
)


#: A digit string longer than this is above every bound the tools have; it never reaches int()
#: (which refuses 4301 digits and more with a ValueError).
_MAX_DIGITS = 30
_INTEGER = re.compile(r"[+-]?[0-9]+")
_EXAMPLE_SIZES = "such as 1,2,4,8"


def _integer(low: int, high: int, note: str = "") -> Callable[[str], int]:
    """An argparse type for an integer whose range (``low..high``, ``note`` saying more) the
    command checks itself; a value of more than ``_MAX_DIGITS`` digits is refused here."""

    def integer(text: str) -> int:
        word = text.strip()
        if not _INTEGER.fullmatch(word):
            raise argparse.ArgumentTypeError(
                f"must be an integer in {low}..{high}{note}; got {shown(text)}"
            )
        if len(word.lstrip("+-0")) > _MAX_DIGITS:
            raise argparse.ArgumentTypeError(f"must be at most {high}{note}; got {shown(word)}")
        return int(word)

    return integer


def _count(maximum: int, why: str) -> Callable[[str], int]:
    """An argparse type for a count in ``1..maximum``; ``why`` says where the bound comes from."""

    def count(text: str) -> int:
        word = text.strip()
        integer = _INTEGER.fullmatch(word) is not None
        if not integer or word.startswith("-") or not word.strip("+0"):
            raise argparse.ArgumentTypeError(
                f"must be an integer >= 1; got {shown(word if integer else text)}"
            )
        if len(word.lstrip("+0")) > _MAX_DIGITS or int(word) > maximum:
            raise argparse.ArgumentTypeError(
                f"must be at most {maximum} ({why}); got {shown(word.lstrip('+'))}"
            )
        return int(word)

    return count


def _sizes(maximum: int, why: str) -> Callable[[str], list[int]]:
    """An argparse type for a comma-separated list of sizes in ``1..maximum``. An empty entry
    (``1,,2``, ``1,2,``) is an error, not skipped: it is no setting FastDeploy would take."""

    def sizes(text: str) -> list[int]:
        if not text.strip():
            raise argparse.ArgumentTypeError(
                f"sizes must be comma-separated positive integers {_EXAMPLE_SIZES}; got {text!r}"
            )
        words = [part.strip() for part in text.split(",")]
        for index, word in enumerate(words, 1):
            if not word:
                raise argparse.ArgumentTypeError(
                    f"entry {index} of {shown(text)} is empty; give comma-separated positive "
                    f"integers {_EXAMPLE_SIZES}, with no empty entry"
                )
            if not _INTEGER.fullmatch(word):
                raise argparse.ArgumentTypeError(
                    f"entry {index}, {shown(word)}, is not an integer; give comma-separated "
                    f"positive integers {_EXAMPLE_SIZES}; got {shown(text)}"
                )
        for word in words:
            if word.startswith("-") or not word.strip("+0"):
                raise argparse.ArgumentTypeError(
                    f"sizes must be positive integers; got {shown(text)}"
                )
        for word in words:
            digits = word.lstrip("+0")
            if len(digits) > _MAX_DIGITS or int(digits) > maximum:
                raise argparse.ArgumentTypeError(
                    f"size {shown(digits)} is above {maximum}, {why}; give sizes in 1..{maximum}"
                )
        return [int(word) for word in words]

    return sizes


#: FastDeploy keeps sequence lengths in int32: no size it takes is larger.
_PLAN_SIZES = _sizes(
    TOKEN_LIMIT, "the most tokens a FastDeploy step holds (int32 sequence lengths)"
)


def _seed(text: str) -> int:
    word = text.strip()
    integer = _INTEGER.fullmatch(word) is not None
    if not integer or len(word.lstrip("+-0")) > _MAX_DIGITS or not 0 <= int(word) <= DEMO_MAX_SEED:
        raise argparse.ArgumentTypeError(
            f"must be an integer in 0..{DEMO_MAX_SEED}; got {shown(word if integer else text)}"
        )
    return int(word)


class _Terminated(BaseException):
    """SIGTERM arrived: unwind (temporary files are removed on the way) and exit 143."""


class _Interrupts:
    """Ctrl-C or SIGTERM seen during this command, even where a library swallowed the exception.

    Paddle's import runs bare ``except:`` clauses (``paddle/base/core.py``): an interrupt there
    is swallowed and can surface later as an ImportError, which must not read as "no Paddle".
    Paddle's import also installs its own C++ handler for SIGTERM, which prints a C++ traceback
    to standard output ("FatalError: `Termination signal` is detected by the operating system");
    ``reinstall()`` after that import puts this quiet one back.
    """

    _RAISES: ClassVar[dict[int, type[BaseException]]] = {
        signal.SIGINT: KeyboardInterrupt,
        signal.SIGTERM: _Terminated,
    }

    def __init__(self) -> None:
        self.seen: int | None = None

    def _handler(self, signum: int, frame: object) -> None:
        self.seen = signum
        raise self._RAISES[signum]

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        self.seen = None
        try:
            previous = {signum: signal.signal(signum, self._handler) for signum in self._RAISES}
        except ValueError:  # not the main thread: leave signals alone
            yield
            return
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def reinstall(self) -> None:
        """Take SIGTERM back from a library that replaced the handler below Python (Paddle)."""
        if signal.getsignal(signal.SIGTERM) == self._handler:
            signal.signal(signal.SIGTERM, self._handler)

    def check(self) -> None:
        """Raise again what a signal raised, so no output claims what did not happen."""
        if self.seen is not None:
            raise self._RAISES[self.seen]


_INTERRUPTS = _Interrupts()


def _cmd_demo(args: argparse.Namespace) -> int:
    try:
        import paddle  # noqa: F401
    except ImportError:
        _INTERRUPTS.check()
        print(
            "fd-cudagraph demo needs Paddle. Install the CPU wheel with pip install "
            "paddlepaddle==3.3.1 (what a checkout's demo extra installs: pip install "
            "'/path/to/fd-cudagraph-plugin[demo]'); on a GPU machine keep your paddlepaddle-gpu.",
            file=sys.stderr,
        )
        return 2
    _INTERRUPTS.check()
    _INTERRUPTS.reinstall()
    from fd_cudagraph_plugin.tools.demo import format_report, run_demo

    # The demo prints the capture summary and the stats table itself; keep warnings only.
    logging.getLogger("fd_cudagraph_plugin").setLevel(logging.WARNING)

    report = run_demo(sizes=args.sizes, steps=args.steps, seed=args.seed, runtime_name=args.runtime)
    _INTERRUPTS.check()
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
            fastdeploy_version=args.fastdeploy_version,
        )
    )
    _INTERRUPTS.check()
    print(_json(plan.to_json()) if args.json else format_plan(plan))
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    from fd_cudagraph_plugin.tools.traces import read_histogram
    from fd_cudagraph_plugin.tools.tune import format_result, tune

    if args.trace.count("-") > 1:
        raise ConfigError("standard input (-) can be given once among the trace files.")
    result = tune(
        read_histogram(args.trace),
        args.max_graphs,
        args.max_size,
        args.num_speculative_tokens,
        fastdeploy_version=args.fastdeploy_version,
    )
    _INTERRUPTS.check()
    print(_json(result.to_json()) if args.json else format_result(result))
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from fd_cudagraph_plugin.tools.doctor import exit_code, format_results, run_checks

    results = run_checks()
    _INTERRUPTS.check()
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


_NUM_SEQS = _integer(1, 512, " (256 on FastDeploy 2.4 and 2.5)")
_SPECULATIVE_TOKENS = _integer(1, MAX_SPECULATIVE_TOKENS)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan",
        help="print the capture sizes and padding maps FastDeploy derives for these settings",
        description="The capture sizes, padding maps and graphs per backend that FastDeploy "
        "derives for these serving settings: computed by the installed FastDeploy's own FDConfig "
        "when it is the release asked for, else by the project's copy of that release's rules.",
    )
    plan.add_argument(
        "--max-num-seqs",
        type=_NUM_SEQS,
        default=8,
        help="max_num_seqs, at most 256 on 2.4 and 2.5 and 512 later (default 8, FastDeploy's "
        "CLI default)",
    )
    plan.add_argument(
        "--spec-method",
        choices=SPEC_METHODS,
        default=None,
        help="speculative decoding method (default: none, no speculative decoding)",
    )
    plan.add_argument(
        "--num-speculative-tokens",
        type=_SPECULATIVE_TOKENS,
        default=None,
        help=f"draft tokens k, 1..{MAX_SPECULATIVE_TOKENS} (default 1 with --spec-method, "
        "FastDeploy's default)",
    )
    plan.add_argument(
        "--tensor-parallel-size",
        type=_integer(1, MAX_TENSOR_PARALLEL_SIZE),
        default=1,
        help=f"tensor_parallel_size, 1..{MAX_TENSOR_PARALLEL_SIZE} (default 1)",
    )
    plan.add_argument(
        "--sequence-parallel-moe",
        action="store_true",
        help="use_sequence_parallel_moe: keeps decode sizes divisible by TP",
    )
    plan.add_argument(
        "--graph-opt-level",
        type=_integer(0, 2),
        choices=(0, 1, 2),
        default=0,
        help="graph_opt_level: 0 dynamic, 1 static (SOT), 2 static with CINN (default 0)",
    )
    plan.add_argument(
        "--full-cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="full_cuda_graph (default true); --no-full-cuda-graph with level >= 1 is static split",
    )
    plan.add_argument(
        "--max-capture-shape-prefill",
        type=_integer(1, MAX_PREFILL_SHAPE),
        default=None,
        help=f"max_capture_shape_prefill, 1..{MAX_PREFILL_SHAPE} (default 512; 2.5 and later)",
    )
    plan.add_argument("--only-prefill", action="store_true", help="cudagraph_only_prefill")
    plan.add_argument(
        "--capture-sizes",
        type=_PLAN_SIZES,
        default=None,
        help="cudagraph_capture_sizes, e.g. 1,2,4,8 (default: FastDeploy's automatic list)",
    )
    plan.add_argument(
        "--capture-sizes-prefill",
        type=_PLAN_SIZES,
        default=None,
        help="cudagraph_capture_sizes_prefill, static split (default: FastDeploy's automatic "
        "list, or 1,2,4,8 with --capture-sizes)",
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
        default=None,
        help="draft_model_use_cudagraph for MTP (default: the release's, true on develop "
        "(r3_mm_dev) and false on the others)",
    )
    _add_release(plan)
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
    tune.add_argument(
        "--max-graphs",
        type=_integer(1, DECODE_CAP),
        required=True,
        help=f"at most this many sizes, 1..{DECODE_CAP} (required)",
    )
    tune.add_argument(
        "--num-speculative-tokens",
        type=_SPECULATIVE_TOKENS,
        default=None,
        help="k of MTP/ngram/suffix decoding: read a plain trace as running requests per step "
        "and fit the sizes FastDeploy multiplies by k + 1 (default: the k stats files record, "
        "else none: a plain trace holds token counts)",
    )
    tune.add_argument(
        "--max-size",
        type=_integer(1, DECODE_CAP),
        default=None,
        help="largest capture size (default: largest observed count); steps above it run "
        "eagerly and are left out",
    )
    _add_release(tune)
    tune.add_argument("--json", action="store_true", help="print JSON")
    tune.set_defaults(run=_cmd_tune)


def _add_release(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fastdeploy-version",
        choices=RELEASES,
        default=None,
        help="apply the rules of this FastDeploy tree, read from the branch named: "
        + ", ".join(f"{name} ({rules.branch} at {rules.commit})" for name, rules in RULES.items())
        + " (default: the installed FastDeploy's, else develop); the installed FastDeploy "
        "computes them when it is that tree",
    )


def _add_demo(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser(
        "demo",
        help="capture and serve a small model through the backend",
        description="Capture a small decoder at the given sizes in a capture session, serve "
        "random decode steps through the plugin's backend and compare every one with eager. The "
        "demo always runs the plugin's backend (FD_CUDAGRAPH_BACKEND=native is refused), and "
        "writes no file unless asked (FD_CUDAGRAPH_MEMORY_REPORT, FD_CUDAGRAPH_STATS_FILE, "
        "FD_CUDAGRAPH_DUMP_DOT).",
    )
    demo.add_argument(
        "--sizes",
        type=_sizes(DEMO_MAX_SIZE, DEMO_SIZE_BOUND),
        default=None,
        help=f"capture sizes, each in 1..{DEMO_MAX_SIZE}, e.g. 1,2,4,8 (default "
        f"{','.join(map(str, DEFAULT_SIZES))})",
    )
    demo.add_argument(
        "--steps",
        type=_count(DEMO_MAX_STEPS, "the demo's limit"),
        default=200,
        help=f"decode steps to serve, 1..{DEMO_MAX_STEPS} (default 200)",
    )
    demo.add_argument(
        "--seed",
        type=_seed,
        default=0,
        help=f"seed of the step sizes and token ids, 0..{DEMO_MAX_SEED} (default 0)",
    )
    demo.add_argument(
        "--runtime",
        choices=("cuda", "simulated"),
        default=None,
        help="cuda: real CUDA graphs (paddlepaddle-gpu); simulated: CUDA-graph replay semantics "
        "on the CPU (default: FD_CUDAGRAPH_RUNTIME when set, else cuda when Paddle has CUDA, "
        "else simulated; said in the output)",
    )
    demo.set_defaults(run=_cmd_demo)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, except that --help and --version fail when standard output cannot be
    written: argparse swallows the OSError of that write (``_print_message``) and exits 0."""

    def _print_message(self, message: str, file: object = None) -> None:
        if message and file is not None and file is sys.stdout:
            sys.stdout.write(message)  # an OSError reaches main(): exit 1
            return
        super()._print_message(message, file)

    def error(self, message: str) -> NoReturn:
        """One line, as every other bad input is said, and where to read the usage."""
        self.exit(2, f"{self.prog}: {message}. See {self.prog} --help.\n")


def build_parser() -> argparse.ArgumentParser:
    from fd_cudagraph_plugin import __version__

    parser = _Parser(prog="fd-cudagraph", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"fd-cudagraph {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_plan(sub)
    _add_tune(sub)
    doctor = sub.add_parser(
        "doctor",
        help="check that FastDeploy will load and use the plugin here, with fixes",
        description="Check, in the environment FastDeploy runs in, that FastDeploy will load the "
        "plugin and use its backend: one OK, WARN or FAIL line per check, with the fix. Exit 1 "
        "when a check fails.",
    )
    doctor.add_argument("--json", action="store_true", help="print JSON")
    doctor.set_defaults(run=_cmd_doctor)
    return parser


#: A value that begins with a minus and a digit (``-1,2``): argparse takes it for an option
#: (it is no plain negative number) and says "expected one argument" instead of checking it.
_NEGATIVE_VALUE = re.compile(r"-\d")


def _attach_negative_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--capture-sizes -1,2`` -> ``--capture-sizes=-1,2``, so the value gets its own error."""
    takes_value = set()
    parsers = [parser]
    while parsers:
        current = parsers.pop()
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
            elif action.option_strings and action.nargs != 0:
                takes_value.update(action.option_strings)
    joined: list[str] = []
    index = 0
    while index < len(argv):
        word = argv[index]
        following = argv[index + 1] if index + 1 < len(argv) else ""
        if word in takes_value and _NEGATIVE_VALUE.match(following):
            joined.append(f"{word}={following}")
            index += 2
        else:
            joined.append(word)
            index += 1
    return joined


def _drop_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout replaced (pytest) or already closed
        pass


class _Tolerant(io.TextIOBase):
    """Standard error as the tools write to it: a message that cannot be written (stderr closed,
    full, or a reader gone) is dropped, and never turns the exit code into a write failure."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            self._target.write(text)
        return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            self._target.flush()


def main(argv: list[str] | None = None) -> int:
    """Run one command; exit 2 on bad input (a closed stdout included), 130 on Ctrl-C, 1 when
    stdout cannot be written."""
    # With stderr closed Python sets it to None, and print(file=None) writes to stdout: an
    # error line would land in the output a script reads.
    if not isinstance(sys.stderr, _Tolerant):
        sys.stderr = _Tolerant(sys.stderr)
    if sys.stdout is None:
        # Started with standard output closed (`>&-`): the command still runs, so that bad input
        # is said as such, and its result goes nowhere; a file this command opens could
        # otherwise take descriptor 1.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the process's stdout from now on
        code = main(argv)
        if code != 2:  # it ran; 2 is bad input, already said
            print(
                "fd-cudagraph: standard output is closed; nothing to write the result to. "
                "Redirect it to a file or /dev/null instead.",
                file=sys.stderr,
            )
            return 2
        return code
    try:
        with _INTERRUPTS.watching():
            parser = build_parser()
            try:
                args = parser.parse_args(
                    _attach_negative_values(parser, sys.argv[1:] if argv is None else list(argv))
                )
            except SystemExit as exit_info:
                if exit_info.code in (0, None):
                    # --help and --version print, then exit 0; their output must be written too,
                    # here where a full disk or a closed pipe gets exit 1, not at interpreter exit.
                    sys.stdout.flush()
                raise
            try:
                code = args.run(args)
            except CudaGraphPluginError as error:
                _INTERRUPTS.check()
                print(f"fd-cudagraph: {error}", file=sys.stderr)
                return 2
            # A full disk or a closed pipe shows up at the flush; make it happen here, inside
            # the handlers, not at interpreter exit.
            sys.stdout.flush()
            return code
    except KeyboardInterrupt:
        print("fd-cudagraph: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        return 128 + signal.SIGTERM
    except BrokenPipeError:
        _drop_stdout()
        return 1
    except OSError as error:
        _drop_stdout()
        print(f"fd-cudagraph: cannot write the output: {error.strerror or error}", file=sys.stderr)
        return 1
