"""``fd-cudagraph`` (also ``python -m fd_cudagraph_plugin``): plain argparse.

Each value option has a type that parses it and checks its one bound (``Integer``, ``Sizes``);
a bad value is one line naming the option, the bound and the value. The checks that depend on
other settings (a release's ``max_num_seqs`` limit, a method's ``k``) are the commands' own.
Signals: ``paddle_import.watching()`` around every command, since any of them may import Paddle
(``demo``, ``doctor``; ``plan`` and ``tune`` through an installed FastDeploy).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import signal
import sys
from typing import Any, NoReturn

from fd_cudagraph_plugin.core.errors import CudaGraphPluginError
from fd_cudagraph_plugin.core.fit import Budget
from fd_cudagraph_plugin.core.options import read_option
from fd_cudagraph_plugin.tools import launch, paddle_import
from fd_cudagraph_plugin.tools.capture_rules import (
    DECODE_CAP,
    RULES,
    TREE_NAMES,
    VERSION_FORMS,
    UnknownVersion,
    rules_for_version,
)
from fd_cudagraph_plugin.tools.demo import (
    DEFAULT_SIZES,
    DEMO_MAX_SEED,
    DEMO_MAX_SIZE,
    DEMO_MAX_STEPS,
    DEMO_SIZE_BOUND,
)
from fd_cudagraph_plugin.tools.wording import as_integer as _as_integer
from fd_cudagraph_plugin.tools.wording import shown

DESCRIPTION = (
    "fd-cudagraph (also python -m fd_cudagraph_plugin): plan, tune and check the CUDA-graph "
    "backend that fd-cudagraph-plugin puts into FastDeploy."
)


class Integer:
    """An integer option in ``low..high``; ``why`` says where the bound comes from."""

    def __init__(self, low: int, high: int, why: str = "") -> None:
        self.low, self.high, self.why = low, high, f" ({why})" if why else ""

    def __call__(self, text: str) -> int:
        value = _as_integer(text)
        if value is None or not self.low <= value <= self.high:
            raise argparse.ArgumentTypeError(
                f"must be an integer in {self.low}..{self.high}{self.why}; got {shown(text)}"
            )
        return int(value)


class Sizes:
    """A comma-separated list of sizes in ``1..high``. An empty entry (``1,,2``) is an error, not
    skipped: it is no setting FastDeploy would take."""

    def __init__(self, high: int, why: str) -> None:
        self.high, self.why = high, why

    def __call__(self, text: str) -> tuple[int, ...]:
        give = f"give comma-separated integers in 1..{self.high} such as 1,2,4,8"
        values = []
        for index, word in enumerate(text.split(","), 1):
            value = _as_integer(word)
            if not word.strip():
                raise argparse.ArgumentTypeError(f"entry {index} of {text!r} is empty; {give}")
            if value is None:
                raise argparse.ArgumentTypeError(
                    f"entry {index}, {shown(word.strip())}, is not an integer; {give}"
                )
            if value < 1:
                raise argparse.ArgumentTypeError(
                    f"sizes must be positive integers; got {shown(text)}"
                )
            if value > self.high:
                raise argparse.ArgumentTypeError(
                    f"size {shown(word.strip().lstrip('+'))} is above {self.high}, {self.why}; "
                    f"give sizes in 1..{self.high}"
                )
            values.append(int(value))
        return tuple(values)


def _fit(text: str) -> Budget | None:
    """``--fit``: FD_CUDAGRAPH_FIT's value, read as the option reads it (``Budget.parse``)."""
    try:
        return Budget.parse(text.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{error}; got {shown(text)}") from None


def _version(text: str) -> str:
    try:
        rules_for_version(text)
    except UnknownVersion as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text.strip()


# ------------------------------------------------------------------ commands


def _cmd_demo(args: argparse.Namespace) -> int:
    from fd_cudagraph_plugin.tools.demo import run_command

    return run_command(args.sizes, args.steps, args.seed, args.runtime)


def _json(document: dict) -> str:
    """Valid JSON with one top-level key per line, each value compact (maps run to 512 keys)."""
    rows = [f"  {json.dumps(key)}: {json.dumps(value)}" for key, value in document.items()]
    return "{\n" + ",\n".join(rows) + "\n}"


def _cmd_plan(args: argparse.Namespace) -> int:
    from fd_cudagraph_plugin.tools.plan import derive_plan, format_plan

    # As register() reads it: a bad value is the error a worker would start with.
    fit = read_option("FD_CUDAGRAPH_FIT")
    plan = derive_plan(launch.read(args.launch, args.fastdeploy_version), fit=fit)
    paddle_import.check()
    print(_json(plan.to_json()) if args.json else format_plan(plan))
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    from fd_cudagraph_plugin.tools.tune import format_result, run_tune

    result = run_tune(args)
    paddle_import.check()
    print(_json(result.to_json()) if args.json else format_result(result))
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from fd_cudagraph_plugin.tools.doctor import exit_code, format_results, run_checks, to_json

    results = run_checks()
    paddle_import.check()
    print(json.dumps(to_json(results), indent=2) if args.json else format_results(results))
    return exit_code(results)


# ------------------------------------------------------------------ the parser


_LAUNCH_LINE = (
    "The rest of the command line is the deployment's FastDeploy launch line, as it is spelt "
    "there (python -m fastdeploy.entrypoints.openai.api_server --model ... --max-num-seqs 64 "
    "--graph-optimization-config '{...}' --speculative-config '{...}'), head included or not. "
    "The installed FastDeploy's own parser reads it where it is the release asked for; "
    "elsewhere fd-cudagraph reads the flags that change what is captured and names the others."
)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan",
        allow_abbrev=False,
        usage="fd-cudagraph plan [--fastdeploy-version V] [--json] [FASTDEPLOY LAUNCH LINE ...]",
        help="print the capture sizes and padding maps FastDeploy derives for a launch line",
        description="The capture sizes, padding maps and graphs per backend that FastDeploy "
        "derives for a launch line: computed by the installed FastDeploy's own FDConfig when it "
        "is the release asked for, else by the project's copy of that release's rules. "
        + _LAUNCH_LINE,
    )
    _add_release(plan)
    plan.add_argument("--json", action="store_true", help="print JSON")
    plan.set_defaults(run=_cmd_plan)


def _add_tune(sub: argparse._SubParsersAction) -> None:
    tune = sub.add_parser(
        "tune",
        allow_abbrev=False,
        usage="fd-cudagraph tune TRACE [TRACE ...] [--max-graphs N] [--max-size N] "
        "[--fit graphs:N|padding:P] [--fastdeploy-version V] [--json] [FASTDEPLOY LAUNCH LINE ...]",
        help="choose the capture sizes that pad a recorded decode trace least",
        description="Choose at most N capture sizes with the fewest padded tokens over a decode "
        "trace (exact), and compare them with the deployed list (cudagraph_capture_sizes of the "
        "launch line, or what the stats files record), else with FastDeploy's default list. "
        "Every list is what FastDeploy keeps of it for that launch (filter_capture_size under "
        "tensor and expert parallelism), as plan prints it. The trace files come first. "
        + _LAUNCH_LINE,
    )
    tune.add_argument(
        "trace",
        nargs="+",
        help="one decode token count per line, or the plugin's fd-cudagraph-stats/1 JSON "
        "lines; - reads standard input; each file once. A plain trace holds running requests "
        "per step where the launch line's --speculative-config gives mtp, ngram or suffix "
        "(unless the stats files record k)",
    )
    tune.add_argument(
        "--max-graphs",
        type=Integer(1, DECODE_CAP, "FastDeploy's largest decode list"),
        default=None,
        help=f"at most this many sizes, 1..{DECODE_CAP} (default: as many as the list compared "
        "with, the deployed one or FastDeploy's default, so the tuned list takes about the same "
        "capture time and graph memory and pads fewer tokens)",
    )
    tune.add_argument(
        "--max-size",
        type=Integer(1, DECODE_CAP, "FastDeploy's largest decode graph"),
        default=None,
        help="largest capture size (default: largest observed count); steps above it run "
        "eagerly and are left out",
    )
    tune.add_argument(
        "--fit",
        type=_fit,
        default=None,
        metavar="graphs:N|padding:P",
        help="also print what FD_CUDAGRAPH_FIT with this value would capture at a recapture after "
        "this traffic: the subset of FastDeploy's list (the deployed one, else the default) that "
        "pads these steps least, at most N graphs or within P percent more padded tokens, its "
        "padding against the whole list, and the line to set (default: off, nothing printed)",
    )
    _add_release(tune)
    tune.add_argument("--json", action="store_true", help="print JSON")
    tune.set_defaults(run=_cmd_tune)


def _add_release(parser: argparse.ArgumentParser) -> None:
    trees = "; ".join(f"{name}: {rules.branch} at {rules.commit}" for name, rules in RULES.items())
    parser.add_argument(
        "--fastdeploy-version",
        type=_version,
        default=None,
        help=f"{VERSION_FORMS} (default: the installed FastDeploy's, else develop). Each is "
        f"answered by the rules of one source tree of gongshaotian/FastDeploy, named in the "
        f"output ({trees}); the trees {' and '.join(TREE_NAMES)} are taken by name too",
    )


def _add_demo(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser(
        "demo",
        help="capture and serve a small model through the backend",
        description="Capture a small decoder at the given sizes in a capture session, serve "
        "random decode steps through the plugin's backend and compare every one with eager. The "
        "demo always runs the plugin's backend (FD_CUDAGRAPH_BACKEND=native is refused), and "
        "writes no file unless asked (FD_CUDAGRAPH_MEMORY_REPORT, FD_CUDAGRAPH_STATS_FILE, "
        "FD_CUDAGRAPH_DUMP_DOT). Progress and the step rate go to standard error.",
    )
    demo.add_argument(
        "--sizes",
        type=Sizes(DEMO_MAX_SIZE, DEMO_SIZE_BOUND),
        default=None,
        help=f"capture sizes, each in 1..{DEMO_MAX_SIZE}, e.g. 1,2,4,8 (default "
        f"{','.join(map(str, DEFAULT_SIZES))})",
    )
    demo.add_argument(
        "--steps",
        type=Integer(1, DEMO_MAX_STEPS, "the demo's limit"),
        default=200,
        help=f"decode steps to serve, 1..{DEMO_MAX_STEPS} (default 200)",
    )
    demo.add_argument(
        "--seed",
        type=Integer(0, DEMO_MAX_SEED),
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
    """argparse's parser with three changes: a value that begins with a minus and a digit
    (``--max-size -1``) is a value to check, not an option; a usage error is one line; and
    --help and --version fail when standard output cannot be written (argparse swallows the
    OSError of that write and exits 0)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # argparse takes only plain negative numbers for values; no option here starts "-<digit>".
        self._negative_number_matcher = re.compile(r"-[0-9]")

    def _print_message(self, message: str, file: object = None) -> None:
        if message and file is not None and file is sys.stdout:
            sys.stdout.write(message)  # an OSError reaches main(): exit 1
            return
        super()._print_message(message, file)

    def error(self, message: str) -> NoReturn:
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
        "plugin and use its backend: one OK, WARN, FAIL or SKIP line per check, with the fix. "
        "Exit 1 when a check fails.",
    )
    doctor.add_argument("--json", action="store_true", help="print JSON")
    doctor.set_defaults(run=_cmd_doctor)
    return parser


def _launch_line(
    parser: argparse.ArgumentParser, args: argparse.Namespace, words: list[str], rest: list[str]
) -> list[str]:
    """What the command's own options left: FastDeploy's launch line for ``plan`` and ``tune``,
    an error for the others. Tune's trace files come first: a file after a launch flag could be
    that flag's value, which only FastDeploy's parser knows."""
    if args.command not in ("plan", "tune"):
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return []
    if args.command == "tune" and rest:
        first = words.index(rest[0])
        late = [trace for trace in args.trace if words.index(trace) > first]
        if late:
            parser.error(
                f"the trace file {late[0]} comes after FastDeploy's flags ({rest[0]}); give the "
                "trace files first, then the launch line"
            )
    return rest


# ------------------------------------------------------------------ running one command


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
    """Run one command; exit 2 on bad input (a closed stdout included), 130 on Ctrl-C, 143 on
    SIGTERM, 1 when stdout cannot be written."""
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
        with paddle_import.watching():
            parser = build_parser()
            words = sys.argv[1:] if argv is None else list(argv)
            try:
                args, rest = parser.parse_known_args(words)
                args.launch = _launch_line(parser, args, words, rest)
            except SystemExit as exit_info:
                if exit_info.code in (0, None):
                    # --help and --version print, then exit 0; their output must be written too,
                    # here where a full disk or a closed pipe gets exit 1, not at interpreter exit.
                    sys.stdout.flush()
                raise
            try:
                code = args.run(args)
            except CudaGraphPluginError as error:
                paddle_import.check()
                print(f"fd-cudagraph: {error}", file=sys.stderr)
                return 2
            # A full disk or a closed pipe shows up at the flush; make it happen here, inside
            # the handlers, not at interpreter exit.
            sys.stdout.flush()
            return code
    except paddle_import.PaddleInterrupted:
        print("fd-cudagraph: interrupted while Paddle was loading", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("fd-cudagraph: interrupted", file=sys.stderr)
        return 130
    except paddle_import.Terminated:
        return 128 + signal.SIGTERM
    except BrokenPipeError:
        _drop_stdout()
        return 1
    except OSError as error:
        _drop_stdout()
        print(f"fd-cudagraph: cannot write the output: {error.strerror or error}", file=sys.stderr)
        return 1
