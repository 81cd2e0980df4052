"""The command line: parses arguments, calls the library, renders, picks the exit code. No logic of its own.

argparse, not click: every `ckpt-doctor inspect` pays the import of its parser, and click's costs ~15 ms of a
~50 ms run (it imports inspect, typing, uuid, datetime …); argparse costs ~2 ms.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys

from ._version import __version__
from .errors import CkptDoctorError, UsageError

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Any, Callable

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
        from .render.columns import printable

        line = printable(line)
    if color and _use_color(sys.stderr, no_color):
        line = f"\x1b[1;{_ANSI[color]}m{line}\x1b[0m"
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def echo(text: str) -> None:
    """Data, on stdout."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _allow_global_option(p: Any) -> None:
    p.add_argument("--allow-global", dest="allow_global", action="append", default=[], metavar="MODULE.NAME",
                   help="Also accept this global as safe (repeatable), as torch.serialization.add_safe_globals does: "
                   "for your own config classes. Names known to run code (os, sys, eval, …) cannot be allowed.")


def _require_default_load_option(p: Any) -> None:
    p.add_argument("--require-default-load", action="store_true",
                   help="Exit 1 unless torch.load(path) with torch's defaults loads the file on this machine: "
                   "weights_only=True (torch >= 2.6) refuses globals off torch's own list, such as an "
                   "argparse.Namespace, and a tensor saved on a device this machine lacks needs map_location. For CI "
                   "before publishing a checkpoint.")


def _write_page(path: str, text: str, inputs: tuple) -> None:
    """An --html page, written as every output is: a temporary file beside it, synced, renamed; never an input."""
    from pathlib import Path

    from .writers.atomic import atomic_output, check_destination

    out = Path(path)
    if out.is_file():  # a page written before is replaced (a CI job re-runs); anything else is refused
        with open(out, "rb") as f:
            head = f.read(512)
        from .render.html import GENERATOR

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
    """The command run with its allow-list in force: the defaults and its --allow-global names, for this command
    only (built and checked here, so a refused name is the command's own usage error)."""

    def run(**args: Any) -> int:
        from .safepickle.policy import Policy

        with Policy.allowing(args.get("allow_global", ())).applied():
            return func(**args)

    run.__name__, run.__doc__ = func.__name__, func.__doc__
    return run


_ARGV: list[str] = []  # the command line being run: an error's way out is this command, changed


def _rerun_command(rerun: Any) -> str:
    """A way out of an error as the whole command to paste: the user's own, with the flags it needs."""
    from .advice import command_line, rerun_argv

    argv = rerun_argv(_ARGV, rerun.add, rerun.remove) if _ARGV else None
    return f"`{command_line(argv)}`" if argv is not None else rerun.describe()


def handle_errors(func: Callable[..., int]) -> Callable[..., None]:
    """One `Error: …` line and exit 2 for every failure; tracebacks only with CKPT_DOCTOR_DEBUG=1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        debug = os.environ.get("CKPT_DOCTOR_DEBUG") == "1"
        for stream in (sys.stdout, sys.stderr):  # a key that is no valid UTF-8 is shown escaped, never a crash
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(errors="backslashreplace")
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


MAIN_HELP = """Inspect, diagnose, repair and verify PyTorch checkpoints — without running code from them.

\b
ckpt-doctor inspect model.pth                     what is inside (nothing run)
ckpt-doctor inspect model.pth --model nets.py:Net why it will not load; the fix
ckpt-doctor fix model.pth -o clean.safetensors --strip-module
ckpt-doctor verify clean.pt --model nets.py:Net --input-shape 8,3,32,32
ckpt-doctor scan downloads/                       what its pickles would run
ckpt-doctor diff base.pt tuned.pt --html d.html   what fine-tuning changed
ckpt-doctor inspect runs/                         every checkpoint in a folder
"""

COMMANDS: dict[str, tuple[Callable[[Any], None], str, Callable[..., None]]] = {}


def command(options: Callable[[Any], None], epilog: str) -> Callable:
    """Register a subcommand: `options` adds its arguments to a parser; the function's docstring is its help."""

    def register(func: Callable[..., int]) -> Callable[..., None]:
        wrapped = handle_errors(_under_policy(func))
        COMMANDS[func.__name__] = (options, epilog, wrapped)
        return wrapped

    return register


def main(argv: list[str] | None = None) -> None:
    """The `ckpt-doctor` entry point: parse, run the command, exit with its code."""
    from_console = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        _parser(None).print_help(sys.stderr)
        sys.stderr.write(f"Error: name a command ({', '.join(COMMANDS)})\n")
        sys.exit(2)
    _ARGV[:] = argv
    name = argv[0] if argv[0] in COMMANDS else None  # only the parser of the command asked for is built
    parser = _parser(name)
    parser.command = name
    args = vars(parser.parse_args(argv))
    args.pop("command", None)
    try:
        COMMANDS[name][2](**args)
    finally:
        if from_console:  # the process ends here: Python's shutdown would run the cycle collector over every
            gc.freeze()  # object made (~2.5 ms for 1,000 tensors); frozen objects are skipped by it


class _Parser(argparse.ArgumentParser):
    command: str | None = None  # the command asked for: its --help is the one to point at

    def error(self, message: str) -> None:  # type: ignore[override]  # one line and exit 2, as every bad input
        if message.endswith("expected one argument"):  # argparse takes a value starting with "-" for an option
            message += " (a value that starts with '-' is written --option=-value)"
        prog = self.prog if self.command is None or self.prog.endswith(self.command) else \
            f"{self.prog} {self.command}"
        sys.stderr.write(f"Error: {message} (see `{prog} --help`)\n")
        sys.exit(2)


def _parser(only: str | None) -> _Parser:
    """The parser; with `only`, the other commands are listed but their options not built."""
    import re

    def formatter(prog: str) -> argparse.HelpFormatter:
        return _HelpFormatter(prog, max_help_position=30, width=_help_width())

    top = _Parser(prog="ckpt-doctor", description=MAIN_HELP, epilog=EXIT_CODES, formatter_class=formatter,
                 allow_abbrev=False)
    top.add_argument("--version", action="version", version=f"ckpt-doctor {__version__}")
    sub = top.add_subparsers(title="commands", metavar="COMMAND", dest="command",
                             description="`ckpt-doctor COMMAND --help` gives each command's options and examples.")
    for name, (options, epilog, func) in COMMANDS.items():
        doc = _dedent(func.__doc__ or "")
        summary = re.split(r"(?<=[?])\s|[.:]\s", doc, maxsplit=1)[0]  # the first sentence, or up to a colon
        if only is not None and name != only:
            sub.add_parser(name, help=summary, formatter_class=formatter)
            continue
        p = sub.add_parser(name, help=summary, description=doc, epilog=epilog,
                           formatter_class=formatter, allow_abbrev=False)
        options(p)
    return top


@functools.lru_cache(maxsize=None)
def _help_width() -> int:
    """The terminal's width (at most 100), as click and shutil find it, without importing shutil at every start:
    argparse builds a formatter for every option it is given."""
    try:
        columns = int(os.environ.get("COLUMNS", "0")) or os.get_terminal_size(sys.__stdout__.fileno()).columns
    except (OSError, ValueError, AttributeError):
        columns = 80
    return max(min(columns, 100) - 2, 40)


def _dedent(doc: str) -> str:
    """A docstring with the indent of its second line on removed (as inspect.cleandoc, which imports ast)."""
    first, _, rest = doc.partition("\n")
    lines = rest.split("\n")
    indent = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
    return (first.strip() + "\n" + "\n".join(line[indent:] for line in lines)).strip()


class _HelpFormatter(argparse.HelpFormatter):
    """Paragraphs are re-wrapped to the terminal; a paragraph that starts with \\b is kept as written (examples,
    tables), as click does."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        out = []
        for para in text.split("\n\n"):
            if para.startswith("\b\n"):
                out.append("\n".join(indent + line for line in para[2:].split("\n")))
            else:
                out.append(textwrap.fill(" ".join(para.split()), width, initial_indent=indent,
                                         subsequent_indent=indent, break_on_hyphens=False))
        return "\n\n".join(out)


def _path(text: str) -> str:
    if not text:
        raise _type_error("an empty path names no file (use . for this folder)")
    return text


def _fraction(text: str) -> float:
    value = _number(text, float)
    if not 0 < value <= 1:
        raise _type_error(f"{text!r} is not more than 0 and at most 1 (a check that loads nothing proves nothing)")
    return value


def _positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise _type_error(f"{text!r} is not 1 or more")
    return value


def _positive_float(text: str) -> float:
    value = _number(text, float)
    if not 0 < value < float("inf"):
        raise _type_error(f"{text!r} is not a number more than 0")
    return value


def _non_negative_float(text: str) -> float:
    value = _number(text, float)
    if not 0 <= value < float("inf"):
        raise _type_error(f"{text!r} is not a number, 0 or more")
    return value


def _number(text: str, kind: type) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise _type_error(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None


def _type_error(message: str) -> Exception:
    return argparse.ArgumentTypeError(message)


def _inspect_options(p: Any) -> None:
    p.add_argument("ckpt", metavar="CKPT", type=_path, help="A checkpoint file or folder.")
    p.add_argument("--json", dest="as_json", action="store_true", help="Print a JSON object on stdout instead of the "
                   "table.")
    p.add_argument("--stats", action="store_true", help="Read tensor data (one tensor at a time) for "
                   "min/max/mean/std, NaN/Inf counts and BatchNorm layers whose running stats were never updated. "
                   "Imports torch.")
    p.add_argument("--filter", dest="filter_", metavar="REGEX", help="Only list tensors whose key matches REGEX "
                   "(re.search).")
    p.add_argument("--full", action="store_true", help="One row per tensor; by default repeated blocks are collapsed "
                   "(layers.{0..23}.attn.q.weight) and long lists shortened.")
    p.add_argument("--model", dest="model_spec", metavar="SPEC", help="Compare with a model: package.module:attr or "
                   "path/to/file.py:attr (a class or factory, built on the meta device), or a reference checkpoint.")
    p.add_argument("--model-arg", dest="model_args", action="append", default=[], metavar="KEY=VALUE",
                   help="Argument for the model's constructor (repeatable; values are Python literals).")
    p.add_argument("--allow-missing", metavar="REGEX", help="Accept model keys matching REGEX being missing or of "
                   "another shape (a new head when fine-tuning).")
    p.add_argument("--allow-unexpected", metavar="REGEX", help="Accept checkpoint keys matching REGEX the model "
                   "lacks.")
    p.add_argument("--min-loaded", type=_fraction, metavar="FRACTION", help="Fail unless at least this share of the "
                   "model's parameters (by elements) is filled, e.g. 0.99.")
    p.add_argument("--select", metavar="PATH", help="With --model: compare the state_dict at PATH (model_ema, "
                   "state_dict.model) instead of the one ckpt-doctor finds.")
    p.add_argument("--values", action="store_true", help="With a reference checkpoint as --model: max |difference| "
                   "per tensor.")
    p.add_argument("--html", dest="html_out", metavar="FILE", type=_path, help="Also write a self-contained page (no "
                   "network): parameters per module, per-tensor value histograms and NaN/Inf/constant flags (reads "
                   "the data, as --stats), the verdict and fix with --model.")
    _require_default_load_option(p)
    _allow_global_option(p)
    p.add_argument("--no-color", action="store_true", help="No colour on stderr (NO_COLOR is honoured too).")


@command(_inspect_options, EXIT_CODES)
def inspect(ckpt: str, as_json: bool, stats: bool, filter_: str | None, full: bool, model_spec: str | None,
            model_args: tuple[str, ...], allow_missing: str | None, allow_unexpected: str | None,
            min_loaded: float | None, select: str | None, values: bool, html_out: str | None,
            require_default_load: bool, allow_global: tuple[str, ...], no_color: bool) -> int:
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
    from .report import inspect_checkpoint

    # A short-lived process building an acyclic tree of ~10 objects per tensor: the cycle collector would walk
    # it over and over (a fifth of the time for 20,000 tensors) and never free anything.
    gc.disable()
    if model_args and not model_spec:
        raise UsageError("--model-arg needs --model")
    args = None
    if model_spec:  # modelspec imports ast: only paid when a model is given
        from .modelspec import parse_model_args

        args = parse_model_args(model_args)
    if select is not None and not model_spec:
        raise UsageError("--select needs --model (it picks the state_dict compared with the model)")
    from .errors import SeveralCheckpoints

    try:
        report = inspect_checkpoint(ckpt, stats=stats or bool(html_out), filter=filter_, model=model_spec,
                                    model_args=args, allow_missing=allow_missing,
                                    allow_unexpected=allow_unexpected, min_loaded=min_loaded, values=values,
                                    select=select, require_default_load=require_default_load)
    except SeveralCheckpoints as exc:
        needs_one = [flag for flag, given in (("--model", model_spec), ("--stats", stats), ("--html", html_out),
                                              ("--filter", filter_), ("--values", values)) if given]
        if needs_one:  # a listing has one line per file: these need the file named
            raise UsageError(f"{exc} ({needs_one[0]} needs one checkpoint)") from None
        return _inspect_folder(exc.folder, as_json, no_color, require_default_load)
    if html_out:
        from .render.html import inspect_html

        _write_page(html_out, inspect_html(report), report.checkpoint.files or (report.checkpoint.path,))
    if as_json:
        from .render.json_out import dumps, inspect_json

        echo(dumps(inspect_json(report)))
    else:
        from .render.lines import color_of
        from .render.table import inspect_summary, inspect_table

        echo(inspect_table(report, full=full))
        for line in inspect_summary(report, full=full):
            say(line, color=color_of(line), no_color=no_color)
    return report.exit_code


def _inspect_folder(folder: Any, as_json: bool, no_color: bool, require_default_load: bool = False) -> int:
    """A folder of many checkpoints: one line per file (read several at once), a total; exit as the worst file."""
    from .listing import list_folder
    from .render.lines import color_of
    from .render.listing_out import listing_json, listing_summary, listing_table

    listing = list_folder(folder, require_default_load)
    if as_json:
        from .render.json_out import dumps

        echo(dumps(listing_json(listing)))
    elif listing.files:
        echo(listing_table(listing))
    for line in listing_summary(listing):
        say(line, color=color_of(line), no_color=no_color)
    return listing.exit_code if listing.files or listing.problems else 2


def _fix_options(p: Any) -> None:
    p.add_argument("ckpt", metavar="CKPT", type=_path, help="A checkpoint file or folder.")
    p.add_argument("-o", "--output", required=True, type=_path, help="Where to write. The suffix picks the format "
                   "(.safetensors, or .pt/.pth/.bin for torch).")
    p.add_argument("--strip-module", action="store_true", help="Remove a leading `module.` (DataParallel/DDP) where "
                   "present.")
    p.add_argument("--add-module", action="store_true", help="Add a leading `module.` to every key.")
    p.add_argument("--strip-prefix", action="append", default=[], metavar="P", help="Remove a leading prefix P where "
                   "present (keys without it are left alone). P is whole key components: module means module. "
                   "(to cut inside a component, use --rename). Repeatable.")
    p.add_argument("--add-prefix", action="append", default=[], metavar="P", help="Add prefix P (whole components: "
                   "model means model.) to every key. Repeatable.")
    p.add_argument("--rename", action="append", default=[], metavar="REGEX=REPL", help="re.sub(REGEX, REPL, key). "
                   "Repeatable.")
    p.add_argument("--drop", action="append", default=[], metavar="REGEX", help="Leave out tensors and entries whose "
                   "path matches (e.g. --drop '^optimizer'). Repeatable.")
    p.add_argument("--select", metavar="PATH", help="Write only the tensors under PATH, keyed relative to it: the "
                   "state_dict of a training checkpoint (state_dict, model, ema) or a sub-module of a whole-model "
                   "pickle. --select '' is all of the file: nested as saved in a torch output (exactly as without "
                   "--select), every tensor in a safetensors one. What is left out is listed as dropped.")
    p.add_argument("--map-location", action="append", default=[], metavar="DEV|FROM=TO",
                   help="Rewrite saved device tags for good: `cpu` (all tensors) or `cuda:3=cuda:0`. Repeatable.")
    p.add_argument("--dtype", metavar="DT", help="Cast floating tensors to float16 (half, fp16), bfloat16 (bf16), "
                   "float32 (float, fp32) or float64 (double, fp64); integer buffers such as num_batches_tracked are "
                   "untouched.")
    p.add_argument("--model", dest="model_spec", metavar="SPEC", help="The model the output must load into "
                   "(package.module:attr, file.py:attr or a reference checkpoint): the output is checked with torch's "
                   "loading code before anything is written, and refused when it would not load strictly. Needed by "
                   "--auto, --reorder and --map-by-order.")
    p.add_argument("--model-arg", dest="model_args", action="append", default=[], metavar="KEY=VALUE",
                   help="Constructor argument.")
    p.add_argument("--auto", action="store_true", help="Apply the fix `inspect --model` suggests.")
    p.add_argument("--reorder", action="store_true", help="Put keys in the model's state_dict() order.")
    p.add_argument("--map-by-order", action="store_true", help="Rename by position, every shape checked; refuses "
                   "when neighbouring tensors share a shape unless --force.")
    p.add_argument("--allow-missing", metavar="REGEX", help="With --model: the output may lack model keys matching "
                   "REGEX (a new head, kept from the model's own initialisation). Without it, an output that would "
                   "not load strictly is refused.")
    p.add_argument("--allow-unexpected", metavar="REGEX", help="With --model: the output may hold keys matching "
                   "REGEX the model lacks.")
    p.add_argument("--tie", dest="ties", action="append", default=[], metavar="ALIAS=KEY",
                   help="Also write ALIAS as the same tensor as KEY (one storage), as a model with tied weights "
                   "expects (lm_head.weight=transformer.wte.weight).")
    p.add_argument("--format", dest="format_", choices=["torch", "safetensors", "dcp"],
                   help="Override the suffix. dcp: a torch.distributed.checkpoint folder (OUT is a folder) that "
                   "dcp.load reads into an FSDP2/DTensor model, to resume distributed training.")
    p.add_argument("--max-shard-size", metavar="SIZE", help="Split the output into shards of at most SIZE (5GB, "
                   "500MB, 2GiB) with an OUT.index.json naming them, as Hugging Face does.")
    p.add_argument("--dry-run", action="store_true", help="Print old → new for every key and what the output would "
                   "hold; write nothing.")
    p.add_argument("--force", action="store_true", help="Replace an existing output; accept an ambiguous "
                   "--map-by-order.")
    p.add_argument("--no-verify", action="store_true", help="Skip re-reading the output (not recommended).")
    p.add_argument("--allow-unsafe", action="store_true", help="Rewrite a file that names dangerous globals, keeping "
                   "only its tensors and plain data (nothing from the file is ever run or written back).")
    _allow_global_option(p)
    p.add_argument("--json", dest="as_json", action="store_true", help="Print the result as JSON on stdout.")


@command(_fix_options, EXIT_CODES)
def fix(ckpt: str, output: str, as_json: bool, allow_global: tuple[str, ...], **flags: Any) -> int:
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
    ckpt-doctor fix train.ckpt -o model.pt --select state_dict --strip-prefix model. --drop '^optimizer'
    ckpt-doctor fix model.pth -o fixed.pt --model mypkg.nets:ResNet --auto
    ckpt-doctor fix gpu.pt -o cpu.pt --map-location cpu
    ckpt-doctor fix ckpt/step_1000/ -o model.safetensors    (a DCP or DeepSpeed folder: consolidated)
    ckpt-doctor fix ckpt/step_1000/ -o full.pt --select ''  (all of it: optimizer state, step, …)
    ckpt-doctor fix model.pt -o resume_dir --format dcp     (a DCP folder FSDP2 can dcp.load)
    """
    import signal

    gc.disable()  # as in inspect: one pass over an acyclic tree of records, nothing for the collector to free
    from .cliparse import fix_options
    from .fix.run import prepare_fix, write_fix
    from .render.fix_out import dry_run_table, fix_json, fix_summary

    if hasattr(signal, "SIGXFSZ"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file-size limit becomes EFBIG, reported, not a crash
    options = fix_options(allow_global=allow_global, **flags)  # the one place the flags become the library's options
    plan = prepare_fix(ckpt, output, options)
    if options.dry_run:
        if as_json:
            from .render.json_out import dumps

            echo(dumps(fix_json(plan, None)))
        else:
            echo(dry_run_table(plan))
        for line in fix_summary(plan, None):
            say(line)
        return 0
    result = write_fix(plan, options, progress_bar())
    if as_json:
        from .render.json_out import dumps

        echo(dumps(fix_json(plan, result)))
    for line in fix_summary(plan, result):
        say(line)
    return 0


def _diff_options(p: Any) -> None:
    p.add_argument("a", metavar="A", type=_path, help="The checkpoint compared from (the reference).")
    p.add_argument("b", metavar="B", type=_path, help="The checkpoint compared with A.")
    p.add_argument("--atol", type=_non_negative_float, default=0.0, help="Absolute tolerance: pairs within it count "
                   "as the same (torch.isclose's rule, |B - A| <= atol + rtol*|A|). (default: %(default)s)")
    p.add_argument("--rtol", type=_non_negative_float, default=0.0, help="Relative tolerance (see --atol). (default: "
                   "%(default)s)")
    p.add_argument("--json", dest="as_json", action="store_true", help="Print a JSON object on stdout instead of the "
                   "table.")
    p.add_argument("--full", action="store_true", help="One row per tensor; by default repeated blocks are "
                   "collapsed.")
    p.add_argument("--html", dest="html_out", metavar="FILE", type=_path, help="Also write a self-contained page (no "
                   "network): the verdict, the largest changes, a heat map of relative change over depth.")
    p.add_argument("--strip-prefix", dest="strip_prefix", action="append", default=[], metavar="P",
                   help="Map A's names onto B's yourself (as fix does; repeatable): remove a leading P from A's "
                   "keys.")
    p.add_argument("--add-prefix", dest="add_prefix", action="append", default=[], metavar="P",
                   help="Add a leading P to A's keys.")
    p.add_argument("--rename", dest="rename", action="append", default=[], metavar="REGEX=REPL",
                   help="re.sub on A's keys.")
    _allow_global_option(p)


@command(_diff_options, DIFF_EXIT_CODES)
def diff(a: str, b: str, atol: float, rtol: float, as_json: bool, full: bool, html_out: str | None,
         strip_prefix: tuple[str, ...], add_prefix: tuple[str, ...], rename: tuple[str, ...],
         allow_global: tuple[str, ...]) -> int:
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
    from .diff import diff_checkpoints
    from .render.diff_out import diff_json, diff_summary, diff_table
    from .render.lines import color_of

    gc.disable()
    # One BLAS thread: each dot product is over a 256 KB block, and OpenBLAS splitting it across threads costs more
    # than the product (a 1 GB pair changed throughout: 1.47 s with threads, 1.15 s without). Set before NumPy loads.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from . import transforms as T

    steps = [T.strip_prefix(p) for p in strip_prefix] + [T.add_prefix(p) for p in add_prefix]
    steps += [T.rename(r) for r in rename]
    report = diff_checkpoints(a, b, atol=atol, rtol=rtol, transforms=tuple(steps))
    if html_out:
        from .render.html import diff_html

        _write_page(html_out, diff_html(report), (report.a.path, report.b.path))
    if as_json:
        from .render.json_out import dumps

        echo(dumps(diff_json(report)))
    else:
        echo(diff_table(report, full))
    for line in diff_summary(report):
        say(line, color=color_of(line))
    return report.exit_code


def _verify_options(p: Any) -> None:
    p.add_argument("ckpt", metavar="CKPT", type=_path, help="A checkpoint file or folder.")
    p.add_argument("--model", dest="model_spec", required=True, metavar="SPEC", help="package.module:attr or "
                   "path/to/file.py:attr: the model class or factory.")
    p.add_argument("--model-arg", dest="model_args", action="append", default=[], metavar="KEY=VALUE",
                   help="Constructor argument.")
    p.add_argument("--input-shape", dest="input_shapes", action="append", default=[], metavar="8,3,32,32",
                   help="Shape of a seeded random input (repeatable for several inputs). The first size is the "
                   "batch.")
    p.add_argument("--input-dtype", default="float32", metavar="DTYPE", help="dtype of the generated inputs. "
                   "(default: %(default)s)")
    p.add_argument("--input-range", default="0,100", metavar="LOW,HIGH", help="Range of integer inputs (token ids). "
                   "(default: %(default)s)")
    p.add_argument("--input", dest="input_fn", metavar="MODULE:FUNCTION", help="A function returning the input(s).")
    p.add_argument("--gpus", default=2, type=_positive_int, metavar="N", help="DataParallel devices and DDP world "
                   "size. (default: %(default)s)")
    p.add_argument("--mode", dest="modes", default="single,dp,ddp", metavar="MODES",
                   help="Which runs, comma separated. (default: %(default)s)")
    p.add_argument("--timeout", default=300.0, type=_positive_float, metavar="SECONDS",
                   help="Seconds before a DDP run that has not finished is killed and reported as hung. (default: "
                   "%(default)s)")
    p.add_argument("--allow-skip", action="store_true", help="Exit 0 when a mode was skipped for lack of GPUs.")
    p.add_argument("--summary", action="store_true", help="Each module's output shape and parameter count.")
    p.add_argument("--compare-to", metavar="OTHER_CKPT", help="Run OTHER_CKPT too and name the first module (in "
                   "execution order) whose output differs: another checkpoint of this model, loaded with the renames "
                   "inspect --model infers (the file CKPT was repaired from); with --compare-model, the original "
                   "of a checkpoint mapped by order, in its own model.")
    p.add_argument("--compare-model", metavar="SPEC", help="The model OTHER_CKPT was saved from (as --model): it runs "
                   "there, and its modules are paired with this model's in the order they run.")
    p.add_argument("--compare-model-arg", dest="compare_model_args", action="append", default=[],
                   metavar="KEY=VALUE", help="Constructor argument for --compare-model (repeatable).")
    p.add_argument("--select", metavar="PATH", help="Verify the state_dict at PATH in the file (model_ema, "
                   "state_dict.model) instead of the one found.")
    p.add_argument("--allow-missing", metavar="REGEX", help="Accept model keys matching REGEX being missing or of "
                   "another shape: the model keeps its own values there (a fine-tuned head), as in inspect --model.")
    p.add_argument("--allow-unexpected", metavar="REGEX", help="Accept (and leave out) checkpoint keys matching "
                   "REGEX the model does not have.")
    p.add_argument("--min-loaded", type=_fraction, metavar="FRACTION", help="Run nothing unless at least this share "
                   "of the model's parameters (by elements) comes from the checkpoint, e.g. 0.99.")
    p.add_argument("--rtol", type=_non_negative_float, help="Relative tolerance for comparing outputs (default: "
                   "torch.testing.assert_close's for each output's dtype, x16 where the batch was split).")
    p.add_argument("--atol", type=_non_negative_float, help="Absolute tolerance for comparing outputs (default as "
                   "--rtol).")
    _allow_global_option(p)
    p.add_argument("--json", dest="as_json", action="store_true", help="Print the report as JSON.")


@command(_verify_options, EXIT_CODES)
def verify(ckpt: str, model_spec: str, model_args: tuple[str, ...], input_shapes: tuple[str, ...], input_dtype: str,
           input_range: str, input_fn: str | None, gpus: int, modes: str, timeout: float, allow_skip: bool,
           summary: bool, compare_to: str | None, compare_model: str | None, compare_model_args: tuple[str, ...],
           select: str | None, allow_missing: str | None, allow_unexpected: str | None, min_loaded: float | None,
           rtol: float | None, atol: float | None, allow_global: tuple[str, ...], as_json: bool) -> int:
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
    from .modelspec import parse_model_args
    from .verify import InputSpec, check_torchrun, parse_modes, parse_shape, verify as run_verify

    low, _, high = input_range.partition(",")
    try:
        bounds = (int(low), int(high))
    except ValueError:
        raise UsageError(f"--input-range {input_range!r}: expected LOW,HIGH such as 0,1000") from None
    from .dtypes import user_dtype_name

    dtype = user_dtype_name(input_dtype)
    if dtype is None:
        raise UsageError(f"--input-dtype {input_dtype!r} is not a torch dtype")
    spec = InputSpec(tuple(parse_shape(s) for s in input_shapes), dtype, bounds[0], bounds[1], input_fn)
    from .outputs import Tolerance
    from .transforms import compile_regex

    for flag, pattern in (("--allow-missing", allow_missing), ("--allow-unexpected", allow_unexpected)):
        if pattern is not None:
            compile_regex(pattern, flag)
    tolerance = Tolerance(rtol, atol)
    args = parse_model_args(model_args)
    other_args = parse_model_args(compare_model_args)
    progress = say if sys.stderr.isatty() else None  # a person waiting at a terminal sees each stage start and end
    if check_torchrun():
        from .verify import verify_under_torchrun

        report = verify_under_torchrun(ckpt, model_spec, args, spec, allow_skip, select, allow_missing,
                                       allow_unexpected, tolerance, min_loaded=min_loaded, timeout=timeout,
                                       summary=summary, compare_to=compare_to, compare_model=compare_model,
                                       compare_model_args=other_args, progress=progress)
        code = 0 if report is None else _report_verify(report, as_json)  # rank 0 reports for all
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
                            compare_model=compare_model, compare_model_args=other_args, progress=progress)
    return _report_verify(report, as_json)


def _report_verify(report, as_json: bool) -> int:
    """The report on stdout (table or JSON), its lines on stderr; the exit code is the report's own."""
    from .advice import rerun_argv
    from .render.verify_out import verify_advice, verify_json, verify_lines, verify_table

    advice = verify_advice(report, lambda flags: rerun_argv(_ARGV, flags))
    if as_json:
        from .render.json_out import dumps

        echo(dumps(verify_json(report, advice)))
    elif report.runs:
        echo(verify_table(report))
    for line, problem in verify_lines(report, advice):
        say(line, color="red" if problem else None)
    return report.exit_code


def _scan_options(p: Any) -> None:
    p.add_argument("paths", nargs="+", metavar="PATH", type=_path, help="Files or folders (searched recursively).")
    p.add_argument("--json", dest="as_json", action="store_true", help="Print the findings as JSON.")
    p.add_argument("--all", dest="show_all", action="store_true", help="List allow-listed globals too.")
    _require_default_load_option(p)
    _allow_global_option(p)
    p.add_argument("--no-color", action="store_true", help="No colour on stderr (NO_COLOR is honoured too).")


@command(_scan_options, EXIT_CODES)
def scan(paths: tuple[str, ...], as_json: bool, show_all: bool, require_default_load: bool,
         allow_global: tuple[str, ...], no_color: bool) -> int:
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
    from .render.scan_out import scan_json, scan_summary, scan_table
    from .scan import scan as run_scan

    report = run_scan(list(paths), require_default_load=require_default_load)
    if as_json:
        from .render.json_out import dumps

        echo(dumps(scan_json(report)))
    else:
        table = scan_table(report, show_all)
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
