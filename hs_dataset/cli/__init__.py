"""``hs-dataset``: plan, build, inspect, push and list versions of hidden-state datasets.

    hs-dataset plan builder_scripts/tiny_demo.py              (before GPU hours: samples, tokens, bytes, time)
    hs-dataset build builder_scripts/tiny_demo.py --output demo_out [--set key=value ...]
    hs-dataset build ... --workers N|auto [--worker-index I]  (one worker of many; or --ray [ADDRESS])
    hs-dataset merge demo_out [SHARE_DIR ...]                (the worker shares into one build)
    hs-dataset inspect demo_out [--plot demo.png]
    hs-dataset push demo_out org/name --version v1.0
    hs-dataset versions org/name
    hs-dataset verify demo_out [--quick] [--probe 64] [--stats]   (or: hs-dataset verify org/name@v1.0)
    hs-dataset derive demo_out [more ...] --output subset [--where FILTER] [--weights W,..] [--budget N]
    hs-dataset export demo_out --to specforge|speculators|modelopt out [--layers 1,29,57]
    hs-dataset import out --from specforge|speculators|modelopt demo_back [--model DIR] [--layers 1,29,57]

`hs-dataset build --help` lists every config field and backend option.

Errors you can fix print one line saying what to do, and exit 2 (--debug or HS_DATASET_DEBUG=1 shows the
traceback); Ctrl-C exits 130 (run the same command again to resume); other errors show their traceback.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import threading
import traceback

from hs_dataset._version import __version__
from hs_dataset.cli.build import cmd_build
from hs_dataset.cli.build import register as register_build
from hs_dataset.cli.derive import register as register_derive
from hs_dataset.cli.hub import dash_version
from hs_dataset.cli.hub import register as register_hub
from hs_dataset.cli.inspect import register as register_inspect
from hs_dataset.cli.interop import register as register_interop
from hs_dataset.cli.options import CliParser, common_parser, load_preset, parse_value, unknown_arguments
from hs_dataset.cli.plan import register as register_plan
from hs_dataset.cli.scale import register as register_scale
from hs_dataset.cli.verify import register as register_verify
from hs_dataset.errors import BuildInterrupted, HsDatasetError
from hs_dataset.processes import interrupt_or_defer, settle_resource_tracker

__all__ = ["EXIT_INTERRUPTED", "EXIT_TERMINATED", "EXIT_USER_ERROR", "cmd_build", "load_preset", "main", "make_parser",
           "parse_value", "run"]

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM, what a process killed by SIGTERM reports
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what `cmd | head` gives for any other command


def make_parser() -> argparse.ArgumentParser:
    """The parser of every command (each module registers its own)."""
    ap = CliParser(prog="hs-dataset", description=(__doc__ or "").replace("``", ""),
               formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"hs-dataset {__version__}")
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error (also: HS_DATASET_DEBUG=1)")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    common = common_parser()
    for register in (register_plan, register_build, register_scale, register_inspect, register_hub, register_verify,
                     register_interop, register_derive):
        register(sub, common)
    return ap


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _debug(a: argparse.Namespace | None) -> bool:
    return bool(getattr(a, "debug", False)) or os.environ.get("HS_DATASET_DEBUG", "") not in ("", "0")


def _silence_stdout() -> None:
    """After a broken pipe (``inspect | head``): point stdout at /dev/null so the exit flush is quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


class _Terminated:
    """SIGTERM (what Slurm sends on preemption, and `kill`) ends the command as Ctrl-C (SIGINT) does: at once,
    or while a build generates a part at its next row (:mod:`hs_dataset.processes`: never lost)."""

    def __init__(self) -> None:
        self.seen = False

    def __call__(self, signum: int, frame: object) -> None:
        if signum == signal.SIGTERM:
            self.seen = True
        interrupt_or_defer()


_DISK_ERRORS = {errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES}


def main(argv: list[str] | None = None, *, exiting: bool = False) -> int:
    """Run one command; return its exit status (2: an error the message says how to fix, 130: Ctrl-C,
    143: SIGTERM; after either, the same command resumes a build). ``exiting``: the process exits next
    (:func:`run`): after SGLang ran, a failure's line is printed once the resource tracker has ended."""
    a: argparse.Namespace | None = None
    terminated = _Terminated()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminated) if main_thread else None
    previous_int = signal.signal(signal.SIGINT, terminated) if main_thread else None
    try:
        parser = make_parser()
        a, extras = parser.parse_known_args(dash_version(sys.argv[1:] if argv is None else list(argv)))
        if extras:  # a misspelt flag: one line naming the closest one, as the other errors
            raise unknown_arguments(parser, a.cmd, extras)
        status = a.fn(a)
        sys.stdout.flush()  # here, where a closed pipe (`inspect | head`) is caught, not at exit
        return status
    except HsDatasetError as e:
        if _debug(a):
            traceback.print_exc()
        if exiting and "sglang" in sys.modules:
            settle_resource_tracker()  # what it prints after a killed scheduler comes before our last line
        prog = f"hs-dataset {a.cmd}" if a is not None else "hs-dataset"
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt as e:
        if _debug(a):
            traceback.print_exc()
        if exiting and "sglang" in sys.modules:
            settle_resource_tracker()
        what = "terminated (SIGTERM)" if terminated.seen else "interrupted"
        if isinstance(e, BuildInterrupted) and e.parts_total:
            print(f"\nhs-dataset: {what} after {e.parts_done} of {e.parts_total} parts; run the same command "
                  "again to resume", file=sys.stderr)
        else:
            print(f"\nhs-dataset: {what}", file=sys.stderr)
        return EXIT_TERMINATED if terminated.seen else EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as e:  # a read-only or full disk (the HF cache, an output): one line naming the path
        if e.errno not in _DISK_ERRORS:
            raise
        if _debug(a):
            traceback.print_exc()
        prog = f"hs-dataset {a.cmd}" if a is not None else "hs-dataset"
        home = os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface")
        where = e.filename or f"a file (the Hub cache is HF_HOME={home}; the output is where --output says)"
        print(f"{prog}: error: cannot write {where}: {e.strerror}; free space there, or point "
              "HF_HOME (the Hub cache) or --output at a writable disk with room, then run the same command again",
              file=sys.stderr)
        return EXIT_USER_ERROR
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
            signal.signal(signal.SIGINT, previous_int if previous_int is not None else signal.default_int_handler)


def run() -> None:
    """The ``hs-dataset`` command: :func:`main`, then exit with its status.

    After SGLang ran in this process, the exit skips the interpreter's teardown (stdout and stderr are
    flushed first, every file of the build is fsynced already): its leftovers (asyncio tasks, a
    resource tracker its shutdown killed) would print tracebacks and logging errors after the summary,
    and a successful build must end with its summary line.
    """
    status = main(exiting=True)
    if "sglang" in sys.modules:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    run()
