"""The command line: parses arguments (click), calls the library, renders, picks the exit code. No logic of its own.

Start-up: every command pays Python (~9 ms) and click (~15 ms); everything else is imported inside the command that
needs it, when it runs: the library's modules, torch only where tensor data is read, tabulate only where a table is
printed (never for --json or --help).
"""

from __future__ import annotations

import functools
import gc
import os
import sys

import click

from ._version import __version__
from .errors import CkptDoctorError, Rerun, SeveralCheckpoints, UsageError

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from typing import Any, Callable

    from .safepickle.policy import Policy

EXIT_CODES = """\b
Exit codes (every command):
  0  done, nothing wrong found
  1  the check found problems (unsafe content, mismatch, failed run)
  2  could not do what was asked (bad usage, unreadable input, refused write)
Set CKPT_DOCTOR_DEBUG=1 to see a traceback instead of a one-line error."""


DIFF_EXIT_CODES = """\b
Exit codes:
  0  the checkpoints are the same (bit for bit, or within --atol/--rtol)
  1  they differ, or one of them would run code under torch.load(weights_only=False)
  2  could not do what was asked (bad usage, unreadable input)
Set CKPT_DOCTOR_DEBUG=1 to see a traceback instead of a one-line error."""


def _use_color(stream: Any, no_color: bool) -> bool:
    return not no_color and "NO_COLOR" not in os.environ and hasattr(stream, "isatty") and stream.isatty()


_ANSI = {"red": 31, "green": 32, "yellow": 33}


def say(line: str = "", *, color: str | None = None, no_color: bool = False) -> None:
    """A line for the person, on stderr (control characters from keys or file names escaped)."""
    if not line.isprintable():
        from .render.columns import printable  # only for a line with control characters: --help imports no renderer

        line = printable(line)
    if color and _use_color(sys.stderr, no_color):
        line = f"\x1b[1;{_ANSI[color]}m{line}\x1b[0m"
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def echo(text: str) -> None:
    """Data, on stdout."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _write_page(path: str, text: str, inputs: tuple) -> None:
    """An --html page, written as every output is: a temporary file beside it, synced, renamed; never an input."""
    from pathlib import Path

    from .writers.atomic import atomic_output, check_destination  # only for --html

    out = Path(path)
    if out.is_file():  # a page written before is replaced (a CI job re-runs); anything else is refused
        with open(out, "rb") as f:
            head = f.read(512)
        from .render.html import GENERATOR  # only for --html

        if GENERATOR.encode() not in head:
            raise UsageError(f"--html {out}: the file exists and is not a page ckpt-doctor wrote; remove it or name "
                             "another file")
    check_destination(out, inputs, force=True)
    data = text.encode("utf-8")
    with atomic_output(out, len(data)) as (fd, _tmp):
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    say(f"wrote {out} ({len(data) / 1024:.0f} KB, self-contained: opens offline)")


def _under_policy(func: Callable[..., int]) -> Callable[..., int]:
    """The command given its allow-list as a value: `policy`, the defaults and its --allow-global names (built and
    checked here, before anything else, so a refused name is the command's own usage error). The command passes it
    to the library call it makes; nothing else knows of it."""

    def run(allow_global: tuple[str, ...] = (), **args: Any) -> int:
        from .safepickle.policy import Policy  # only when a command runs: --help and --version never load the policy

        return func(policy=Policy.allowing(allow_global), **args)

    run.__name__, run.__doc__ = func.__name__, func.__doc__
    return run


_ARGV: list[str] = []  # the command line being run: an error's way out is this command, changed
_KEPT: list[Any] = []  # what a command made, kept until the process ends (_outlive); [True] first when it will soon


def _outlive(made: Any) -> None:
    """Keeps what the command made (a report: a few objects per tensor) until the process ends, when it ends once the
    command returns (ckpt-doctor run from the console) and nothing else is left to tear down: os._exit then leaves
    without freeing them one by one (~8 ms for 20,000 tensors, after the answer is out). As a library: nothing."""
    if _KEPT:
        _KEPT.append(made)


def _rerun_command(rerun: Any) -> str:
    """A way out of an error as the whole command to paste: the user's own, with the flags it needs."""
    from .advice import command_line, rerun_argv  # only when an error offers a rerun

    argv = rerun_argv(_ARGV, rerun.add, rerun.remove) if _ARGV else None
    return f"`{command_line(argv)}`" if argv is not None else rerun.describe()


def _write_refusal(exc: Any) -> str:
    """A dry run's WriteError, each way out the write's own command: the user's, without --dry-run."""

    def command(rerun: Rerun) -> str:
        return _rerun_command(Rerun(add=rerun.add, remove=("--dry-run",))) if not rerun.remove else rerun.describe()

    return exc.render(command)


def _quiet(*_args: Any) -> None:
    """Nothing: what failed in a destructor ends in the command's own `Error:` line or result."""


def handle_errors(func: Callable[..., int]) -> Callable[..., None]:
    """One `Error: …` line and exit 2 for every failure; tracebacks only with CKPT_DOCTOR_DEBUG=1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        debug = os.environ.get("CKPT_DOCTOR_DEBUG") == "1"
        if sys.stdout is None:  # started with stdout closed (`>&-`): nowhere to put the data
            say("Error: stdout is closed: nowhere to print the result (redirect it to a file or /dev/null)")
            sys.exit(2)
        for stream in (sys.stdout, sys.stderr):  # a key that is no valid UTF-8 is shown escaped, never a crash
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(errors="backslashreplace")
        if not debug:  # what CPython meets in a destructor it prints itself, a traceback (a hostile pickle's
            # bytearray freed while a view of it is held: PyErr_Print, through sys.excepthook): the command's own
            # line says what went wrong, and everything the command raises is caught below
            sys.excepthook = sys.unraisablehook = _quiet
        try:
            code = func(*args, **kwargs)
        except CkptDoctorError as exc:
            if debug:
                raise
            say(f"Error: {exc.render(_rerun_command)}", color="red")
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            say("Error: interrupted")
            sys.exit(130)
        except SystemExit as exc:  # ckpt-doctor's own exits come after its command returns: this is the model's
            if debug:
                raise
            say(f"Error: code run from --model or --input called sys.exit({exc.code!r}); stopped without a verdict",
                color="red")
            sys.exit(2)
        except BrokenPipeError:
            sys.exit(0)
        except OSError as exc:  # the system refused a path or a write (a name too long, a full disk): no bug of ours
            if debug:
                raise
            where = f"{exc.filename}: " if exc.filename else "writing the output: " if exc.errno == 28 else ""
            say(f"Error: {where}{exc.strerror or exc}", color="red")
            sys.exit(2)
        except RecursionError:  # the readers and fix walk on stacks of their own; a path that does not is no crash
            if debug:
                raise
            say("Error: the checkpoint nests containers deeper than this command can follow (past Python's "
                "recursion limit)", color="red")
            sys.exit(2)
        except Exception as exc:  # a bug in ckpt-doctor: still one line, never a traceback by default
            if debug:
                raise
            say(f"Error: internal error ({type(exc).__name__}: {exc}); re-run with CKPT_DOCTOR_DEBUG=1 and "
                "report the traceback", color="red")
            sys.exit(2)
        sys.exit(code or 0)

    return wrapper


# ---- click's building blocks, as this command line uses them ----------------------------------------------------


def _terminal_columns() -> int:
    """The terminal's width as shutil.get_terminal_size gives it: $COLUMNS, else the terminal on stdout, else 80."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


class _HelpFormatter(click.HelpFormatter):
    """click's help layout with lines broken at spaces only: an option named in a sentence (--require-default-load)
    is never cut at one of its hyphens. Hyphens are held as U+2011 (a non-breaking hyphen) while click wraps.
    The width is shutil.get_terminal_size's rule, read without importing shutil (which imports bz2 and lzma: a
    few milliseconds of every --help)."""

    def __init__(self, indent_increment: int = 2, width: int | None = None, max_width: int | None = None) -> None:
        if width is None and click.formatting.FORCED_WIDTH is None:
            width = max(min(_terminal_columns(), max_width or 80) - 2, 50)
        super().__init__(indent_increment, width, max_width)

    def write_text(self, text: str) -> None:
        super().write_text(text.replace("-", "\u2011"))

    def write_dl(self, rows: Any, col_max: int = 30, col_spacing: int = 2) -> None:
        super().write_dl([(a.replace("-", "\u2011"), b.replace("-", "\u2011")) for a, b in rows], col_max,
                         col_spacing)

    def getvalue(self) -> str:
        return super().getvalue().replace("\u2011", "-")


class _Context(click.Context):
    formatter_class = _HelpFormatter


class _Command(click.Command):
    """A command whose --help lists its arguments and then its options in titled sections (`sections`: title and
    the parameter names under it; options in none of them are listed last, under "Other options")."""

    context_class = _Context

    def __init__(self, *args: Any, arguments: dict[str, str] | None = None,
                 sections: tuple[tuple[str, tuple[str, ...]], ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.arguments = arguments or {}
        self.sections = sections

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """click takes the word after an option that needs a value as that value, even when it is another of the
        command's options (`--drop --strip-module` would drop nothing and strip nothing): refused, as a usage error.
        A value that starts with '-' is written --option=-value."""
        own = {name: p for p in self.get_params(ctx) if isinstance(p, click.Option)
               for name in (*p.opts, *p.secondary_opts)}
        for word, following in zip(args, args[1:]):
            if word == "--":
                break
            param = own.get(word)
            if param is not None and not param.is_flag and not param.count and following.split("=", 1)[0] in own:
                raise click.UsageError(f"{word} needs a value, and the next word {following} is an option (a value "
                                       f"that starts with '-' is written {word}=-value)", ctx)
        return super().parse_args(ctx, args)

    def get_short_help_str(self, limit: int = 45) -> str:
        """The first sentence of the help, or up to a colon: the group's list of commands shows it whole."""
        import re

        return re.split(r"(?<=[?])\s|[.:]\s", (self.help or "").strip(), maxsplit=1)[0]

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        records = {p.name: p.get_help_record(ctx) for p in self.get_params(ctx) if not isinstance(p, click.Argument)}
        if self.arguments:
            with formatter.section("Arguments"):
                formatter.write_dl(list(self.arguments.items()))
        for title, names in self.sections:
            rows = [records.pop(name) for name in names if records.get(name)]
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)
        rest = [record for record in records.values() if record]
        if rest:
            with formatter.section("Other options"):
                formatter.write_dl(rest)


class _Group(click.Group):
    """The `ckpt-doctor` group: commands listed in the order they were added; a usage error is one `Error:` line
    and exit 2, as every bad input; the run's objects are frozen at exit."""

    command_class = _Command
    context_class = _Context

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_text("`ckpt-doctor COMMAND --help` gives each command's options and examples.")
            formatter.write_paragraph()
            formatter.write_dl([(name, cmd.get_short_help_str()) for name, cmd in self.commands.items()])

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        from_console = args is None
        args = sys.argv[1:] if args is None else list(args)
        if not args and not os.environ.get(complete_var or "_CKPT_DOCTOR_COMPLETE"):
            with self.make_context("ckpt-doctor", ["--help"], resilient_parsing=True) as ctx:
                sys.stderr.write(ctx.get_help() + "\n")
            sys.stderr.write(f"Error: name a command ({', '.join(self.commands)})\n")
            sys.exit(2)
        _ARGV[:] = args
        if from_console:
            _KEPT[:] = [True]
        try:
            # prog_name: "ckpt-doctor" whether started as the console script or `python -m ckpt_doctor`, so the
            # usage lines and the completion variable (_CKPT_DOCTOR_COMPLETE) are the same either way.
            code = super().main(args, prog_name or "ckpt-doctor", complete_var, standalone_mode=False, **extra)
        except SystemExit as exc:  # a command's end (handle_errors): its answer is out
            if from_console and isinstance(exc.code, int) and _nothing_to_tear_down():
                os._exit(exc.code)
            raise
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else \
                "ckpt-doctor" + (f" {args[0]}" if args[0] in self.commands else "")  # the command's help
            sys.stderr.write(f"Error: {exc.format_message()}{_usage_hint(exc)} (see `{where} --help`)\n")
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            sys.stderr.write(f"Error: {exc.format_message()}\n")
            sys.exit(exc.exit_code)
        except click.Abort:
            sys.stderr.write("Error: interrupted\n")
            sys.exit(130)
        finally:
            _KEPT.clear()  # (not ended by os._exit: what the command made goes as Python frees it)
            if from_console:  # the process ends here: Python's shutdown would run the cycle collector over every
                gc.freeze()  # object made (~2.5 ms for 1,000 tensors); frozen objects are skipped by it
        sys.exit(code if isinstance(code, int) else 0)  # --help and --version end here


def _nothing_to_tear_down() -> bool:
    """Whether the process may end at once (os._exit) with its output out: no exit handler (a DCP reader's
    temporary folder registers one), no thread but this one, torch not loaded (its own teardown), and stdout and
    stderr flushed. Python's teardown would free every object the command made, one by one: ~8 ms for 20,000
    tensors, after the answer is out. Every file the commands write is closed (and renamed) before they return."""
    import atexit

    threading = sys.modules.get("threading")
    if "torch" in sys.modules or getattr(atexit, "_ncallbacks", lambda: 1)() \
            or threading is not None and threading.active_count() > 1:
        return False
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:  # (None: started with it closed)
                stream.flush()
    except (OSError, ValueError):  # a closed pipe, a full disk, a closed stream: the usual way, which reports it
        return False
    return True


def _usage_hint(exc: click.UsageError) -> str:
    """What a usage error's reader most likely meant, when click's words do not say it: a path or a value that
    starts with '-'."""
    if isinstance(exc, click.NoSuchOption) and not exc.option_name.startswith("--"):
        return " (a path that starts with '-' goes after --, or is written ./-name)"
    if (isinstance(exc, click.BadOptionUsage) and exc.option_name.startswith("--")
            and exc.format_message().endswith("requires an argument.")):
        return f" (a value that starts with '-' is written {exc.option_name}=-value)"
    return ""


class _PathType(click.Path):
    """A file or folder as given (it is opened later, by the command, whose error names it); never empty."""

    def __init__(self) -> None:
        super().__init__(path_type=str)

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if value == "":
            self.fail("an empty path names no file (use . for this folder)", param, ctx)
        if isinstance(value, str) and value.startswith("hf://") and type(self) is _PathType:
            self.fail(f"{value}: ckpt-doctor reads the Hugging Face cache but never writes into it; give a local "
                      "path", param, ctx)
        return super().convert(value, param, ctx)


class _FloatRange(click.FloatRange):
    """click's FloatRange that refuses NaN too and says why a value is refused."""

    def __init__(self, refused: str, **bounds: Any) -> None:
        super().__init__(**bounds)
        self.refused = refused  # the end of "'x' is not …"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        try:
            import math

            if not math.isnan(number):  # NaN is in no range
                return super().convert(number, param, ctx)
        except click.BadParameter:
            pass
        self.fail(f"{value!r} is not {self.refused}", param, ctx)


class _IntRange(click.IntRange):
    """click's IntRange, saying why a value is refused."""

    def __init__(self, refused: str, **bounds: Any) -> None:
        super().__init__(**bounds)
        self.refused = refused

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        try:
            number = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not an integer", param, ctx)
        try:
            return super().convert(number, param, ctx)
        except click.BadParameter:
            self.fail(f"{value!r} is not {self.refused}", param, ctx)


class _InputType(_PathType):
    """A checkpoint to read: a path, a URL, or a Hugging Face cache reference (hf://org/name[@revision][/file]),
    which is resolved here, offline, to the local snapshot it names (readers/hfcache.py)."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, str) and value.startswith("hf://"):
            from .readers.hfcache import resolve  # only when a hf:// reference is given

            try:
                return str(resolve(value))
            except CkptDoctorError as exc:
                raise _Failed(str(exc)) from None
        return super().convert(value, param, ctx)


class _Failed(click.ClickException):
    """An argument that cannot be read, found while the command line is parsed: one `Error:` line, exit 2."""

    exit_code = 2


PATH = _PathType()
INPUT = _InputType()
CKPT_ARGUMENT = {"CKPT": "A checkpoint file or folder, an https:// or s3:// URL, or hf://org/name[@revision] (a model "
                         "in the local Hugging Face cache)."}
FRACTION = _FloatRange("more than 0 and at most 1 (a check that loads nothing proves nothing)", min=0, max=1,
                       min_open=True)
POSITIVE_INT = _IntRange("1 or more", min=1)
POSITIVE_FLOAT = _FloatRange("a number more than 0", min=0, max=float("inf"), min_open=True, max_open=True)
NON_NEGATIVE_FLOAT = _FloatRange("a number, 0 or more", min=0, max=float("inf"), max_open=True)
# What a command that prints a table prints: the table (tabulate's "simple" look, kept to 120 columns), JSON (as
# --json), or one of tabulate's formats, each row whole: github (markdown: a pull-request comment), grid, tsv.
TABLE_FORMATS = ("table", "json", "github", "markdown", "grid", "tsv")


def _table_format(as_json: bool, format_: str) -> tuple[bool, str]:
    """(JSON?, tabulate's name of the table format) from --json and --format."""
    if format_ in ("table", "json"):
        return as_json or format_ == "json", "simple"
    if as_json:
        raise UsageError(f"--json and --format {format_} ask for two outputs; give one of them")
    return False, "github" if format_ == "markdown" else format_


def _format_option(what: str) -> Callable:
    return click.option("--format", "format_", type=click.Choice(TABLE_FORMATS), default="table", metavar="FORMAT",
                        help=f"How {what} is printed: table (default), json (as --json), or github (alias markdown), "
                        "grid, tsv: tabulate's formats, each row whole (github for a pull-request comment, tsv for a "
                        "spreadsheet).")


_allow_global_option = click.option(
    "--allow-global", "allow_global", multiple=True, metavar="MODULE.NAME",
    help="Also accept this global as safe (repeatable), as torch.serialization.add_safe_globals does: for your own "
         "config classes. Names known to run code (os, sys, eval, …) cannot be allowed.")

_require_default_load_option = click.option(
    "--require-default-load", is_flag=True,
    help="Exit 1 unless torch.load(path) with torch's defaults loads the file on this machine: weights_only=True "
         "(torch >= 2.6) refuses globals off torch's own list, such as an argparse.Namespace, and a tensor saved on "
         "a device this machine lacks needs map_location. For CI before publishing a checkpoint.")

_no_color_option = click.option("--no-color", is_flag=True, help="No colour on stderr (NO_COLOR is honoured too).")


@click.group(cls=_Group, name="ckpt-doctor", epilog=EXIT_CODES,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="ckpt-doctor", message="%(prog)s %(version)s")
def main() -> None:
    """Inspect, diagnose, repair and verify PyTorch checkpoints — without running code from them.

    \b
    ckpt-doctor inspect model.pth                     what is inside (nothing run)
    ckpt-doctor inspect model.pth --model nets.py:Net why it will not load; the fix
    ckpt-doctor fix model.pth -o clean.safetensors --strip-module
    ckpt-doctor verify clean.pt --model nets.py:Net --input-shape 8,3,32,32
    ckpt-doctor scan downloads/                       what its pickles would run
    ckpt-doctor diff base.pt tuned.pt --html d.html   what fine-tuning changed
    ckpt-doctor inspect runs/                         every checkpoint in a folder
    """


@main.command(epilog=EXIT_CODES, arguments=CKPT_ARGUMENT, sections=(
    ("Output", ("as_json", "format_", "full", "filter_", "stats", "html_out", "no_color")),
    ("Against a model", ("model_spec", "model_args", "allow_missing", "allow_unexpected", "min_loaded", "select",
                         "values")),
    ("Safety", ("require_default_load", "allow_global"))))
@click.argument("ckpt", metavar="CKPT", type=INPUT)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object on stdout instead of the table.")
@_format_option("the listing")
@click.option("--stats", is_flag=True, help="Read tensor data (one tensor at a time) for min/max/mean/std, NaN/Inf "
              "counts and BatchNorm layers whose running stats were never updated. Imports torch.")
@click.option("--filter", "filter_", metavar="REGEX", help="Only list tensors whose key matches REGEX (re.search).")
@click.option("--full", is_flag=True, help="One row per tensor; by default repeated blocks are collapsed "
              "(layers.{0..23}.attn.q.weight) and long lists shortened.")
@click.option("--model", "model_spec", metavar="SPEC", help="Compare with a model: package.module:attr or "
              "path/to/file.py:attr (a class or factory, built on the meta device), hf:PATH (a Hugging Face "
              "config.json; hf: alone, the one beside CKPT; hf://org/name, a cached model's), or a reference "
              "checkpoint.")
@click.option("--model-arg", "model_args", multiple=True, metavar="KEY=VALUE",
              help="Argument for the model's constructor (repeatable; values are Python literals).")
@click.option("--allow-missing", metavar="REGEX", help="Accept model keys matching REGEX being missing or of another "
              "shape (a new head when fine-tuning).")
@click.option("--allow-unexpected", metavar="REGEX", help="Accept checkpoint keys matching REGEX the model lacks.")
@click.option("--min-loaded", type=FRACTION, metavar="FRACTION", help="Fail unless at least this share of the "
              "model's parameters (by elements) is filled, e.g. 0.99.")
@click.option("--select", metavar="PATH", help="With --model: compare the state_dict at PATH (model_ema, "
              "state_dict.model) instead of the one ckpt-doctor finds.")
@click.option("--values", is_flag=True, help="With a reference checkpoint as --model: max |difference| per tensor.")
@click.option("--html", "html_out", metavar="FILE", type=PATH, help="Also write a self-contained page (no network): "
              "parameters per module, per-tensor value histograms and NaN/Inf/constant flags (reads the data, as "
              "--stats), the verdict and fix with --model.")
@_require_default_load_option
@_allow_global_option
@_no_color_option
@handle_errors
@_under_policy
def inspect(ckpt: str, as_json: bool, format_: str, stats: bool, filter_: str | None, full: bool, model_spec: str | None,
            model_args: tuple[str, ...], allow_missing: str | None, allow_unexpected: str | None,
            min_loaded: float | None, select: str | None, values: bool, html_out: str | None,
            require_default_load: bool, policy: Policy, no_color: bool) -> int:
    """Show what a checkpoint holds: keys, shapes, dtypes, saved devices, prefixes, metadata, unsafe globals.

    CKPT is a file (torch zip, legacy torch, TorchScript, safetensors, a pickle) or a folder (a shard
    index with its shards, a Hugging Face model folder, a torch.distributed.checkpoint folder, a DeepSpeed
    ZeRO save folder, a Lightning or accelerate folder: whole tensors with their global shapes, and how
    each was sharded). A folder of several checkpoints (a run's saves, a model zoo) is listed one line per file,
    its subfolders included, with a total; several files are read at once. The format is found from the bytes.
    Nothing in the file is run: pickles are read by an unpickler that imports nothing. Every global off the
    allow-list is listed with its verdict — code (a class torch.load would import and call, e.g. a
    whole pickled model) or dangerous (os, subprocess, eval, …) — and makes the exit code 1, exactly
    as `ckpt-doctor scan` judges the file; the tensors are listed all the same.

    With --model, the table gives a verdict per key (matched, missing, unexpected, shape mismatch, dtype
    differs), the summary says what share of the model a load would fill, and prints the exact
    `ckpt-doctor fix …` command that makes a strict load succeed. Exit 1 when a strict load would fail
    (after --allow-missing / --allow-unexpected / --min-loaded), when less of the model than required comes
    from the file (an allowance such as --allow-missing '.*' names nothing in particular), or when the file
    needs code to load (a whole pickled model, TorchScript: the fix line rescues it).

    The torch.load line says whether torch.load(path) with torch's defaults (weights_only=True, no
    map_location) loads the file on this machine, and the ways out when it does not: a global torch refuses
    (an argparse.Namespace), a device this machine lacks. That is a fact, exit 0; --require-default-load
    makes it exit 1.

    \b
    ckpt-doctor inspect model.pth --model mypkg.nets:ResNet --model-arg num_classes=10
    ckpt-doctor inspect ft.pth --model nets.py:Net --allow-missing '^classifier\\.'
    ckpt-doctor inspect new.pt --model old.pt --values      # compare two checkpoints
    ckpt-doctor inspect checkpoints/ --json                 # every checkpoint in a folder, one line each

    The table goes to stdout, the summary to stderr.
    """
    from .report import inspect_checkpoint  # inspect's library, imported only when inspect runs

    # A short-lived process building an acyclic tree of ~10 objects per tensor: the cycle collector would walk
    # it over and over (a fifth of the time for 20,000 tensors) and never free anything.
    gc.disable()
    as_json, tablefmt = _table_format(as_json, format_)
    if model_args and not model_spec:
        raise UsageError("--model-arg needs --model")
    args = None
    if model_spec:  # modelspec imports ast: only paid when a model is given
        from .modelspec import parse_model_args

        args = parse_model_args(model_args)
    if select is not None and not model_spec:
        raise UsageError("--select needs --model (it picks the state_dict compared with the model)")
    try:
        report = inspect_checkpoint(ckpt, stats=stats or bool(html_out), filter=filter_, model=model_spec,
                                    model_args=args, allow_missing=allow_missing,
                                    allow_unexpected=allow_unexpected, min_loaded=min_loaded, values=values,
                                    select=select, require_default_load=require_default_load, policy=policy)
    except SeveralCheckpoints as exc:
        needs_one = [flag for flag, given in (("--model", model_spec), ("--stats", stats), ("--html", html_out),
                                              ("--filter", filter_), ("--values", values)) if given]
        if needs_one:  # a listing has one line per file: these need the file named
            raise UsageError(f"{exc} ({needs_one[0]} needs one checkpoint)") from None
        return _inspect_folder(exc.folder, policy, as_json, no_color, require_default_load, tablefmt)
    if html_out:
        from .render.html import inspect_html  # only for --html

        _write_page(html_out, inspect_html(report), report.checkpoint.files or (report.checkpoint.path,))
    if as_json:
        from .render.json_out import dumps, inspect_json  # only for --json

        document = inspect_json(report, encoded_rows=True)
        echo(dumps(document))
        _outlive(document)
    else:
        from .render.lines import color_of  # only for the table (and the next line): --json never imports table code
        from .render.table import inspect_summary, inspect_table

        echo(inspect_table(report, full=full, tablefmt=tablefmt))
        for line in inspect_summary(report, full=full):
            say(line, color=color_of(line), no_color=no_color)
    _outlive(report)
    return report.exit_code


def _inspect_folder(folder: Any, policy: Policy, as_json: bool, no_color: bool, require_default_load: bool = False,
                    tablefmt: str = "simple") -> int:
    """A folder of many checkpoints: one line per file (read several at once), a total; exit as the worst file."""
    from .listing import list_folder  # only for a folder of checkpoints (and the next two)
    from .render.lines import color_of
    from .render.listing_out import listing_json, listing_summary, listing_table

    listing = list_folder(folder, require_default_load, policy=policy)
    if as_json:
        from .render.json_out import dumps  # only for --json

        echo(dumps(listing_json(listing)))
    elif listing.files:
        echo(listing_table(listing, tablefmt))
    for line in listing_summary(listing):
        say(line, color=color_of(line), no_color=no_color)
    return listing.exit_code if listing.files or listing.problems else 2


@main.command(epilog=EXIT_CODES, arguments=CKPT_ARGUMENT, sections=(
    ("Output", ("output", "format_", "max_shard_size", "dry_run", "force", "no_verify", "as_json")),
    ("Keys", ("strip_module", "add_module", "strip_prefix", "add_prefix", "rename", "drop", "select", "ties")),
    ("Tensors", ("map_location", "dtype")),
    ("Against a model", ("model_spec", "model_args", "auto", "reorder", "map_by_order", "allow_missing",
                         "allow_unexpected")),
    ("Safety", ("plain_data", "allow_unsafe", "allow_global"))))
@click.argument("ckpt", metavar="CKPT", type=INPUT)
@click.option("-o", "--output", required=True, type=PATH, metavar="OUT", help="Where to write. The suffix picks the "
              "format (.safetensors, or .pt/.pth/.bin for torch).")
@click.option("--strip-module", is_flag=True, help="Remove a leading `module.` (DataParallel/DDP) where present.")
@click.option("--add-module", is_flag=True, help="Add a leading `module.` to every key.")
@click.option("--strip-prefix", multiple=True, metavar="P", help="Remove a leading prefix P where present (keys "
              "without it are left alone). P is whole key components: module means module. (to cut inside a "
              "component, use --rename). Repeatable.")
@click.option("--add-prefix", multiple=True, metavar="P", help="Add prefix P (whole components: model means model.) "
              "to every key. Repeatable.")
@click.option("--rename", multiple=True, metavar="REGEX=REPL", help="re.sub(REGEX, REPL, key). Repeatable.")
@click.option("--drop", multiple=True, metavar="REGEX", help="Leave out tensors and entries whose path matches (e.g. "
              "--drop '^optimizer'). Repeatable.")
@click.option("--select", metavar="PATH", help="Write only the tensors under PATH, keyed relative to it: the "
              "state_dict of a training checkpoint (state_dict, model, ema) or a sub-module of a whole-model pickle. "
              "--select '' is all of the file: nested as saved in a torch output (as without --select, but --dtype "
              "then casts all of it), every tensor in a safetensors one. What is left out is listed as dropped.")
@click.option("--map-location", multiple=True, metavar="DEV|FROM=TO", help="Rewrite saved device tags for good: "
              "`cpu` (all tensors) or `cuda:3=cuda:0`. Repeatable.")
@click.option("--dtype", metavar="DT", help="Cast the model's weights (the state_dict written: the one found, or the "
              "part --select names) to float16 (half, fp16), bfloat16 (bf16), float32 (float, fp32) or float64 "
              "(double, fp64). The rest of the file (optimizer state, schedulers, RNG) is written as saved; "
              "--select '' casts all of it. Integer buffers such as num_batches_tracked are untouched. A value the "
              "cast would make inf (float16 holds up to 65504) refuses the write: nothing is written.")
@click.option("--model", "model_spec", metavar="SPEC", help="The model the output must load into "
              "(package.module:attr, file.py:attr, hf:PATH for a Hugging Face config.json or hf://org/name for a "
              "cached model's, or a reference checkpoint): the output is checked with torch's loading code before "
              "anything is written, and refused when it would not load strictly. Needed by "
              "--auto, --reorder and --map-by-order.")
@click.option("--model-arg", "model_args", multiple=True, metavar="KEY=VALUE", help="Constructor argument.")
@click.option("--auto", is_flag=True, help="Apply the fix `inspect --model` suggests.")
@click.option("--reorder", is_flag=True, help="Put keys in the model's state_dict() order.")
@click.option("--map-by-order", is_flag=True, help="Rename by position, every shape checked; refuses when "
              "neighbouring tensors share a shape unless --force.")
@click.option("--allow-missing", metavar="REGEX", help="With --model: the output may lack model keys matching REGEX "
              "(a new head, kept from the model's own initialisation). Without it, an output that would not load "
              "strictly is refused.")
@click.option("--allow-unexpected", metavar="REGEX", help="With --model: the output may hold keys matching REGEX the "
              "model lacks.")
@click.option("--tie", "ties", multiple=True, metavar="ALIAS=KEY", help="Also write ALIAS as the same tensor as KEY "
              "(one storage), as a model with tied weights expects (lm_head.weight=transformer.wte.weight).")
@click.option("--format", "format_", type=click.Choice(["torch", "safetensors", "dcp"]), help="Override the suffix. "
              "dcp: a torch.distributed.checkpoint folder (OUT is a folder) that dcp.load reads into an FSDP2/DTensor "
              "model, to resume distributed training.")
@click.option("--max-shard-size", metavar="SIZE", help="Split the output into shards of at most SIZE (5GB, 500MB, "
              "2GiB; a bare number is bytes) with an OUT.index.json naming them, as Hugging Face does: a tensor "
              "larger than SIZE gets a shard of its own.")
@click.option("--dry-run", is_flag=True, help="Print old → new for every key and what the output would hold; write "
              "nothing.")
@click.option("--force", is_flag=True, help="Replace an existing output; accept an ambiguous --map-by-order.")
@click.option("--no-verify", is_flag=True, help="Skip re-reading the output (not recommended).")
@click.option("--plain-data", is_flag=True, help="Write the objects torch.load refuses that only hold data as that "
              "data, so the output loads with torch's defaults and keeps them: an argparse.Namespace as a dict, a "
              "NumPy scalar as a Python number, a pathlib path as a str. Read from the file, never run.")
@click.option("--allow-unsafe", is_flag=True, help="Rewrite a file that names dangerous globals, keeping only its "
              "tensors and plain data (nothing from the file is ever run or written back).")
@_allow_global_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
@handle_errors
@_under_policy
def fix(ckpt: str, output: str, as_json: bool, policy: Policy, **flags: Any) -> int:
    """Repair a checkpoint into a file that loads: rename keys, pick the state_dict, drop, re-tag, convert.

    The input is never modified. The output is written to a temporary file beside it, fsynced, re-read
    and compared storage by storage (crc32) with the input, then renamed into place: a crash leaves
    either no output or the whole one. Bytes are streamed, so memory stays flat whatever the size.

    \b
    Transforms apply in this order, whatever the order on the command line:
      --select, --drop, --strip-module/--strip-prefix, --rename, --add-module/--add-prefix,
      --map-by-order, --reorder; then --dtype and --map-location.
    Renames act on the keys of the state_dict (the whole checkpoint is kept unless --select is given).

    \b
    ckpt-doctor fix dp.pth -o clean.safetensors --strip-module
    ckpt-doctor fix train.ckpt -o model.pt --select state_dict --strip-prefix model. --drop '^criterion\\.'
    ckpt-doctor fix model.pth -o fixed.pt --model mypkg.nets:ResNet --auto
    ckpt-doctor fix gpu.pt -o cpu.pt --map-location cpu
    ckpt-doctor fix ckpt/step_1000/ -o model.safetensors    (a DCP or DeepSpeed folder: consolidated)
    ckpt-doctor fix ckpt/step_1000/ -o full.pt --select ''  (all of it: optimizer state, step, …)
    ckpt-doctor fix model.pt -o resume_dir --format dcp     (a DCP folder FSDP2 can dcp.load)
    """
    import signal

    gc.disable()  # as in inspect: one pass over an acyclic tree of records, nothing for the collector to free
    from .cliparse import fix_options  # fix's modules (and the next two), imported only when fix runs
    from .fix.run import planned_shards, prepare_fix, write_fix
    from .render.fix_out import dry_run_table, fix_json, fix_summary

    if hasattr(signal, "SIGXFSZ"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file-size limit becomes EFBIG, reported, not a crash
    # the one place the flags become the library's options
    options = fix_options(policy=policy, checkpoint=ckpt, **flags)
    plan = prepare_fix(ckpt, output, options)
    if options.dry_run:
        sharded = planned_shards(plan, options)
        if as_json:
            from .render.json_out import dumps  # only for --json

            echo(dumps(fix_json(plan, None, sharded)))
        else:
            echo(dry_run_table(plan))
        for line in fix_summary(plan, None, sharded):
            say(line)
        if plan.write_refusal is not None:  # said last, where the next command is read from
            say("note: without --dry-run the write would stop: " + _write_refusal(plan.write_refusal))
        return 0
    try:
        result = write_fix(plan, options, progress_bar())
    except CkptDoctorError as exc:  # a way out that changes --dtype takes out the flag as the user spelled it (fp16)
        if flags.get("dtype") is not None:
            exc.reruns = tuple(Rerun(r.add, ("--dtype", flags["dtype"])) if r.remove[:1] == ("--dtype",) else r
                               for r in exc.reruns)
        raise
    if as_json:
        from .render.json_out import dumps  # only for --json

        echo(dumps(fix_json(plan, result)))
    for line in fix_summary(plan, result):
        say(line)
    return 0


@main.command(epilog=DIFF_EXIT_CODES, arguments={"A": "The checkpoint compared from (the reference).",
                                                  "B": "The checkpoint compared with A."}, sections=(
    ("Output", ("as_json", "format_", "full", "html_out")),
    ("Tolerance", ("atol", "rtol")),
    ("Names", ("strip_prefix", "add_prefix", "rename")),
    ("Safety", ("allow_global",))))
@click.argument("a", metavar="A", type=INPUT)
@click.argument("b", metavar="B", type=INPUT)
@click.option("--atol", type=NON_NEGATIVE_FLOAT, default=0.0, metavar="ATOL", help="Absolute tolerance: pairs "
              "within it count as the "
              "same (torch.isclose's rule, |B - A| <= atol + rtol*|A|). (default: 0.0)")
@click.option("--rtol", type=NON_NEGATIVE_FLOAT, default=0.0, metavar="RTOL",
              help="Relative tolerance (see --atol). (default: 0.0)")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object on stdout instead of the table.")
@_format_option("the table of changes")
@click.option("--full", is_flag=True, help="One row per tensor; by default repeated blocks are collapsed.")
@click.option("--html", "html_out", metavar="FILE", type=PATH, help="Also write a self-contained page (no network): "
              "the verdict, the largest changes, a heat map of relative change over depth.")
@click.option("--strip-prefix", multiple=True, metavar="P", help="Map A's names onto B's yourself (as fix does; "
              "repeatable): remove a leading P from A's keys.")
@click.option("--add-prefix", multiple=True, metavar="P", help="Add a leading P to A's keys.")
@click.option("--rename", multiple=True, metavar="REGEX=REPL", help="re.sub on A's keys.")
@_allow_global_option
@handle_errors
@_under_policy
def diff(a: str, b: str, atol: float, rtol: float, as_json: bool, format_: str, full: bool, html_out: str | None,
         strip_prefix: tuple[str, ...], add_prefix: tuple[str, ...], rename: tuple[str, ...],
         policy: Policy) -> int:
    """What changed between two checkpoints: per tensor, shape and dtype changes, max |B - A|, the relative change
    ||B - A|| / ||A|| and the cosine similarity; which tensors stayed bit-identical, which exist on one side only,
    and the BatchNorm layers whose running statistics moved while their weights did not.

    A and B may be any format ckpt-doctor reads (a .pt and its .safetensors copy compare equal). Names are matched
    as `inspect A --model B` matches them, so a DataParallel file lines up with its clean copy; or say how with
    --strip-prefix/--add-prefix/--rename (applied to A's names, as fix applies them). Tensors are read one
    pair at a time; nothing in either file is run. Exit 0 when they are the same (bit for bit, or within
    --atol/--rtol), 1 when they differ, like diff(1).

    \b
    ckpt-doctor diff pretrained.pt finetuned.pt
    ckpt-doctor diff model.pt model.safetensors --json
    ckpt-doctor diff run1/last.ckpt run2/last.ckpt --atol 1e-6

    The table goes to stdout, the summary to stderr.
    """
    from .diff import diff_checkpoints  # diff's modules (and the next two), imported only when diff runs
    from .render.diff_out import diff_json, diff_summary, diff_table
    from .render.lines import color_of

    gc.disable()
    # One BLAS thread: each dot product is over a 256 KB block, and OpenBLAS splitting it across threads costs more
    # than the product (a 1 GB pair changed throughout: 1.47 s with threads, 1.15 s without). Set before NumPy loads.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    as_json, tablefmt = _table_format(as_json, format_)
    from . import transforms as T  # only when diff runs

    steps = [T.strip_prefix(p) for p in strip_prefix] + [T.add_prefix(p) for p in add_prefix]
    steps += [T.rename(r) for r in rename]
    report = diff_checkpoints(a, b, atol=atol, rtol=rtol, transforms=tuple(steps), policy=policy)
    if html_out:
        from .render.html import diff_html  # only for --html

        _write_page(html_out, diff_html(report), (report.a.path, report.b.path))
    if as_json:
        from .render.json_out import dumps  # only for --json

        echo(dumps(diff_json(report)))
    else:
        echo(diff_table(report, full, tablefmt=tablefmt))
    for line in diff_summary(report):
        say(line, color=color_of(line))
    return report.exit_code


@main.command(epilog=EXIT_CODES, arguments=CKPT_ARGUMENT, sections=(
    ("Model and inputs", ("model_spec", "model_args", "input_shapes", "input_dtype", "input_range", "input_fn")),
    ("Runs", ("gpus", "modes", "timeout", "allow_skip", "summary", "rtol", "atol")),
    ("What is loaded", ("select", "allow_missing", "allow_unexpected", "min_loaded")),
    ("Against another checkpoint", ("compare_to", "compare_model", "compare_model_args")),
    ("Output", ("as_json", "format_")),
    ("Safety", ("allow_global",))))
@click.argument("ckpt", metavar="CKPT", type=INPUT)
@click.option("--model", "model_spec", required=True, metavar="SPEC", help="package.module:attr or "
              "path/to/file.py:attr: the model class or factory; or hf:PATH, a Hugging Face config.json "
              "(hf://org/name: a cached model's; hf: alone, the one beside CKPT).")
@click.option("--model-arg", "model_args", multiple=True, metavar="KEY=VALUE", help="Constructor argument.")
@click.option("--input-shape", "input_shapes", multiple=True, metavar="8,3,32,32", help="Shape of a seeded random "
              "input (repeatable for several inputs). The first size is the batch.")
@click.option("--input-dtype", default="float32", metavar="DTYPE", help="dtype of the generated inputs. (default: "
              "float32)")
@click.option("--input-range", default="0,100", metavar="LOW,HIGH", help="Range of integer inputs (token ids). "
              "(default: 0,100)")
@click.option("--input", "input_fn", metavar="MODULE:FUNCTION", help="A function returning the input(s).")
@click.option("--gpus", default=2, type=POSITIVE_INT, metavar="N", help="DataParallel devices and DDP world size. "
              "(default: 2)")
@click.option("--mode", "modes", default="single,dp,ddp", metavar="MODES", help="Which runs, comma separated. "
              "(default: single,dp,ddp)")
@click.option("--timeout", default=300.0, type=POSITIVE_FLOAT, metavar="SECONDS", help="Seconds before a DDP run "
              "that has not finished is killed and reported as hung. (default: 300.0)")
@click.option("--allow-skip", is_flag=True, help="Exit 0 when a mode was skipped for lack of GPUs.")
@click.option("--summary", is_flag=True, help="Each module's output shape and parameter count.")
@click.option("--compare-to", metavar="OTHER_CKPT", help="Run OTHER_CKPT too and name the first module (in execution "
              "order) whose output differs: another checkpoint of this model, loaded with the renames inspect --model "
              "infers (the file CKPT was repaired from); with --compare-model, the original of a checkpoint mapped by "
              "order, in its own model.")
@click.option("--compare-model", metavar="SPEC", help="The model OTHER_CKPT was saved from (as --model): it runs "
              "there, and its modules are paired with this model's in the order they run.")
@click.option("--compare-model-arg", "compare_model_args", multiple=True, metavar="KEY=VALUE",
              help="Constructor argument for --compare-model (repeatable).")
@click.option("--select", metavar="PATH", help="Verify the state_dict at PATH in the file (model_ema, "
              "state_dict.model) instead of the one found.")
@click.option("--allow-missing", metavar="REGEX", help="Accept model keys matching REGEX being missing or of another "
              "shape: the model keeps its own values there (a fine-tuned head), as in inspect --model.")
@click.option("--allow-unexpected", metavar="REGEX", help="Accept (and leave out) checkpoint keys matching REGEX the "
              "model does not have.")
@click.option("--min-loaded", type=FRACTION, metavar="FRACTION", help="Run nothing unless at least this share of the "
              "model's parameters (by elements) comes from the checkpoint, e.g. 0.99.")
@click.option("--rtol", type=NON_NEGATIVE_FLOAT, metavar="RTOL", help="Relative tolerance for comparing outputs "
              "(default: "
              "torch.testing.assert_close's for each output's dtype, x16 where the batch was split).")
@click.option("--atol", type=NON_NEGATIVE_FLOAT, metavar="ATOL",
              help="Absolute tolerance for comparing outputs (default as --rtol).")
@_allow_global_option
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_format_option("the table of runs")
@handle_errors
@_under_policy
def verify(ckpt: str, model_spec: str, model_args: tuple[str, ...], input_shapes: tuple[str, ...], input_dtype: str,
           input_range: str, input_fn: str | None, gpus: int, modes: str, timeout: float, allow_skip: bool,
           summary: bool, compare_to: str | None, compare_model: str | None, compare_model_args: tuple[str, ...],
           select: str | None, allow_missing: str | None, allow_unexpected: str | None, min_loaded: float | None,
           rtol: float | None, atol: float | None, policy: Policy, as_json: bool, format_: str) -> int:
    """Prove a checkpoint works: strict load, then run it alone, under DataParallel and under DDP.

    \b
    single  one process, eval mode: the reference output; NaN/Inf fails.
    dp      nn.DataParallel over --gpus CUDA devices; must match single. Without them the report says
            what ran instead and marks the mode skipped (exit 1 unless --allow-skip).
    ddp     --gpus processes: nccl when that many GPUs exist, else gloo on the CPU (said in the report).
            Each rank loads the file itself, checks its shard against single, takes one backward +
            SGD step; replicas must then be identical and the DDP state_dict must hold the file's keys.
    Started by torchrun (RANK/WORLD_SIZE set), verify joins that process group instead of spawning.
    Nothing runs unless the load fills the model (the share is printed; --min-loaded sets it).

    \b
    ckpt-doctor verify clean.pth --model mypkg.nets:ResNet --input-shape 8,3,32,32 --gpus 2
    ckpt-doctor verify lm.pt --model lm.py:make --input-shape 4,16 --input-dtype int64 --input-range 0,1000
    ckpt-doctor verify last.ckpt --select model_ema --model nets.py:Net --input-shape 8,3,32,32
    ckpt-doctor verify mapped.pt --model new.py:Net --compare-to old.pth --compare-model old.py:OldNet
    """
    from .modelspec import parse_model_args  # verify's modules (and the next line), imported only when verify runs
    from .verify import InputSpec, check_torchrun, parse_modes, parse_shape, verify as run_verify

    as_json, tablefmt = _table_format(as_json, format_)
    low, _, high = input_range.partition(",")
    try:
        bounds = (int(low), int(high))
    except ValueError:
        raise UsageError(f"--input-range {input_range!r}: expected LOW,HIGH such as 0,1000") from None
    if bounds[0] >= bounds[1]:  # torch.randint(low, high) draws from [low, high): it needs low < high
        raise UsageError(f"--input-range {input_range!r}: LOW must be below HIGH (integers are drawn from "
                         "[LOW, HIGH)), e.g. 0,1000")
    from .dtypes import user_dtype_name  # only when verify runs

    dtype = user_dtype_name(input_dtype)
    if dtype is None:
        raise UsageError(f"--input-dtype {input_dtype!r} is not a torch dtype")
    spec = InputSpec(tuple(parse_shape(s) for s in input_shapes), dtype, bounds[0], bounds[1], input_fn)
    from .outputs import Tolerance  # only when verify runs (and the next line)
    from .transforms import compile_regex

    for flag, pattern in (("--allow-missing", allow_missing), ("--allow-unexpected", allow_unexpected)):
        if pattern is not None:
            compile_regex(pattern, flag)
    tolerance = Tolerance(rtol, atol)
    args = parse_model_args(model_args)
    other_args = parse_model_args(compare_model_args)
    progress = say if sys.stderr.isatty() else None  # a person waiting at a terminal sees each stage start and end
    if check_torchrun():
        from .verify import verify_under_torchrun  # only under torchrun

        report = verify_under_torchrun(ckpt, model_spec, args, spec, allow_skip, select, allow_missing,
                                       allow_unexpected, tolerance, min_loaded=min_loaded, timeout=timeout,
                                       summary=summary, compare_to=compare_to, compare_model=compare_model,
                                       compare_model_args=other_args, progress=progress, policy=policy)
        code = 0 if report is None else _report_verify(report, as_json, tablefmt)  # rank 0 reports for all
        # gloo's threads can abort the interpreter's teardown once a peer has left ("terminate called without an
        # active exception"): the verdict is out, so leave without that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if progress:
        progress(f"verifying {ckpt} with {model_spec} (modes {modes}, --gpus {gpus}) …")
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):  # the model's prints while it runs: stdout carries the report
        report = run_verify(ckpt, model_spec, args, spec, gpus, parse_modes(modes), timeout, summary, compare_to,
                            allow_skip, select, allow_missing, allow_unexpected, tolerance, min_loaded=min_loaded,
                            compare_model=compare_model, compare_model_args=other_args, progress=progress,
                            policy=policy)
    return _report_verify(report, as_json, tablefmt)


def _report_verify(report, as_json: bool, tablefmt: str = "simple") -> int:
    """The report on stdout (table or JSON), its lines on stderr; the exit code is the report's own."""
    from .advice import rerun_argv  # only when verify reports (and the next line)
    from .render.verify_out import verify_advice, verify_json, verify_lines, verify_table

    advice = verify_advice(report, lambda flags: rerun_argv(_ARGV, flags))
    if as_json:
        from .render.json_out import dumps  # only for --json

        echo(dumps(verify_json(report, advice)))
    elif report.runs:
        echo(verify_table(report, tablefmt))
    for line, problem in verify_lines(report, advice):
        say(line, color="red" if problem else None)
    return report.exit_code


@main.command(epilog=EXIT_CODES, arguments={"PATH...": "Files or folders (searched recursively), URLs, or "
                                                     "hf://org/name (the local Hugging Face cache)."}, sections=(
    ("Output", ("as_json", "format_", "show_all", "no_color")),
    ("Safety", ("require_default_load", "allow_global"))))
@click.argument("paths", metavar="PATH...", nargs=-1, required=True, type=INPUT)
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
@_format_option("the table of findings")
@click.option("--all", "show_all", is_flag=True, help="List allow-listed globals too.")
@_require_default_load_option
@_allow_global_option
@_no_color_option
@handle_errors
@_under_policy
def scan(paths: tuple[str, ...], as_json: bool, format_: str, show_all: bool, require_default_load: bool,
         policy: Policy, no_color: bool) -> int:
    """Would torch.load(weights_only=False) run code from these files? Every global every pickle names, judged.

    \b
    safe       on the allow-list: torch.load(weights_only=True)'s own list, a few inert records of
               the formats ckpt-doctor reads (DCP metadata, DeepSpeed, argparse.Namespace, numpy
               arrays), and names given with --allow-global
    code       anything else: a class or function torch.load would import and call (a pickled
               whole model, a user class, a TorchScript archive)
    dangerous  known to run commands, evaluate text, touch files or the network, or unpickle more

    Pickles are found wherever they hide: data.pkl and every other pickle member of a zip, all five
    pickles of a legacy file and what follows its storages, the members of a pre-0.4 tar, pickles after
    a STOP or inside byte strings. Nothing is imported or called. Folders are scanned recursively,
    symlinks followed (a Hugging Face cache snapshot), every file sniffed by its content whatever its
    name; the verdict is the worst file's.

    \b
    ckpt-doctor scan downloaded.pth
    ckpt-doctor scan ~/.cache/huggingface/hub/models--org--name/snapshots/ --json

    A file of a folder that is no checkpoint (text, an image, an HDF5 file, a NumPy array) is skipped with a
    line saying what it is, unless it names a global off the allow-list (an object array's pickle can).

    Exit 1 if anything is code or dangerous; 2 if a path is missing or unreadable, a checkpoint is corrupt,
    a file named alone is no checkpoint, or a folder holds nothing to scan.
    """
    from .render.scan_out import scan_json, scan_summary, scan_table  # only when scan runs (and the next line)
    from .scan import scan as run_scan

    as_json, tablefmt = _table_format(as_json, format_)
    report = run_scan(list(paths), require_default_load=require_default_load, policy=policy)
    if as_json:
        from .render.json_out import dumps  # only for --json

        echo(dumps(scan_json(report)))
    else:
        table = scan_table(report, show_all, tablefmt)
        if table is not None:
            echo(table)
    if report.exit_code == 2 and len(report.files) + len(report.problems) == 1:
        # one unreadable path: one line, as everywhere
        say(f"Error: {report.errors[0]}", color="red", no_color=no_color)
        return 2
    for line, bad in scan_summary(report, with_severity=True):
        say(line, color="red" if bad else None, no_color=no_color)
    for problem in report.problems:
        say(f"Error: {problem}", color="red", no_color=no_color)
    unsafe = sum(1 for f in report.files if f.exit_code == 1)
    if unsafe:
        rescued = sum(1 for f in report.files if f.exit_code == 1 and f.rescue is not None)
        how = ("; each file's rescue line writes its tensors and plain data as a file torch.load loads with its "
               "defaults (nothing they name is run or written)") if rescued == unsafe else \
            (f"; the rescue lines of {rescued} of them write their tensors and plain data as files torch.load loads "
             "with its defaults (nothing they name is run or written)") if rescued else ""
        say(f"{report.findings} finding(s): loading {unsafe} file(s) with pickle (torch.load(weights_only=False), "
            f"np.load(allow_pickle=True)) would run code. Never load them that way{how}", color="red",
            no_color=no_color)
    refused = sum(1 for f in report.files if f.refused_by_default_load and f.exit_code != 1)
    if refused:
        say(f"{refused} file(s) that run nothing are refused by torch.load with its defaults here (see their "
            "torch.load lines)" + ("" if report.require_default_load else "; --require-default-load makes that "
                                   "exit 1"), color="red" if report.require_default_load else None, no_color=no_color)
    from .safepickle.policy import Verdict  # only when a scan ends: --help does not pay for the policy

    unread = sum(1 for f in report.files if f.error and f.verdict is Verdict.SAFE)
    if unread:  # nothing is claimed about a file that was not read; when it decides the exit, say so as an error
        say(("Error: " if report.exit_code == 2 else "") + f"{unread} file(s) could not be read: nothing is claimed "
            "about them (see their NOT READ lines)", color="red", no_color=no_color)
    return report.exit_code



def progress_bar():
    """A callback drawing `writing 42% 0.8/2.0 GB` on stderr after the first second, only for a terminal."""
    import time

    if not sys.stderr.isatty():
        return None
    start = time.monotonic()
    last = [0.0]

    def draw(done: int, total: int) -> None:
        now = time.monotonic()
        if now - start < 1.0 or now - last[0] < 0.1 and done < total:
            return
        last[0] = now
        pct = 100 * done // max(total, 1)
        end = "\n" if done >= total else ""
        sys.stderr.write(f"\r  {pct:3d}%  {done / 2**30:.2f}/{total / 2**30:.2f} GB{end}")
        sys.stderr.flush()

    return draw
