"""The command line: parses arguments, calls the library, renders, picks the exit code. No logic of its own."""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable

import click

from ._version import __version__
from .errors import CkptDoctorError, UsageError

EXIT_CODES = """\b
Exit codes (every command):
  0  done, nothing wrong found
  1  the check found problems (unsafe content, mismatch, failed run)
  2  could not do what was asked (bad usage, unreadable input, refused write)
Set CKPT_DOCTOR_DEBUG=1 to see a traceback instead of a one-line error."""


def _use_color(stream: Any, no_color: bool) -> bool:
    return not no_color and "NO_COLOR" not in os.environ and hasattr(stream, "isatty") and stream.isatty()


def say(line: str = "", *, color: str | None = None, no_color: bool = False) -> None:
    """A line for the person, on stderr."""
    if color and _use_color(sys.stderr, no_color):
        line = click.style(line, fg=color, bold=True)
    click.echo(line, err=True)


def handle_errors(func: Callable[..., int]) -> Callable[..., None]:
    """One `Error: …` line and exit 2 for every failure; tracebacks only with CKPT_DOCTOR_DEBUG=1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        debug = os.environ.get("CKPT_DOCTOR_DEBUG") == "1"
        try:
            code = func(*args, **kwargs)
        except CkptDoctorError as exc:
            if debug:
                raise
            say(f"Error: {exc}", color="red")
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            say("Error: interrupted")
            sys.exit(130)
        except BrokenPipeError:
            sys.exit(0)
        except Exception as exc:  # a bug in ckpt-doctor: still one line, never a traceback by default
            if debug:
                raise
            say(f"Error: internal error ({type(exc).__name__}: {exc}); re-run with CKPT_DOCTOR_DEBUG=1 and "
                "report the traceback", color="red")
            sys.exit(2)
        sys.exit(code or 0)

    return wrapper


class Group(click.Group):
    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_epilog(ctx, formatter)


@click.group(epilog=EXIT_CODES, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="ckpt-doctor")
def main() -> None:
    """Inspect, diagnose, repair and verify PyTorch checkpoints — without running code from them.

    \b
    ckpt-doctor inspect model.pth                 what is inside (no torch import, no tensor data read)
    ckpt-doctor inspect model.pth --json          the same as JSON for scripts and CI
    ckpt-doctor inspect model.pth --stats         min/max/mean/std, NaN/Inf, untrained BatchNorm stats
    """


@main.command(epilog=EXIT_CODES)
@click.argument("ckpt", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object on stdout instead of the table.")
@click.option("--stats", is_flag=True, help="Read tensor data (one tensor at a time) for min/max/mean/std, "
              "NaN/Inf counts and BatchNorm layers whose running stats were never updated. Imports torch.")
@click.option("--filter", "filter_", metavar="REGEX", help="Only list tensors whose key matches REGEX (re.search).")
@click.option("--full", is_flag=True, help="One row per tensor; by default repeated blocks are collapsed "
              "(layers.{0..23}.attn.q.weight) and long lists shortened.")
@click.option("--model", "model_spec", metavar="SPEC", help="Compare with a model: package.module:attr or "
              "path/to/file.py:attr (a class or factory, built on the meta device), or a reference checkpoint.")
@click.option("--model-arg", "model_args", multiple=True, metavar="KEY=VALUE",
              help="Argument for the model's constructor (repeatable; values are Python literals).")
@click.option("--allow-missing", metavar="REGEX", help="Accept model keys matching REGEX being missing or of "
              "another shape (a new head when fine-tuning).")
@click.option("--allow-unexpected", metavar="REGEX", help="Accept checkpoint keys matching REGEX the model lacks.")
@click.option("--min-loaded", type=click.FloatRange(0, 1), metavar="FRACTION",
              help="Fail unless at least this share of the model's parameters (by elements) is filled, e.g. 0.99.")
@click.option("--values", is_flag=True, help="With a reference checkpoint as --model: max |difference| per tensor.")
@click.option("--no-color", is_flag=True, help="No colour on stderr (NO_COLOR is honoured too).")
@handle_errors
def inspect(ckpt: str, as_json: bool, stats: bool, filter_: str | None, full: bool, model_spec: str | None,
            model_args: tuple[str, ...], allow_missing: str | None, allow_unexpected: str | None,
            min_loaded: float | None, values: bool, no_color: bool) -> int:
    """Show what a checkpoint holds: keys, shapes, dtypes, saved devices, prefixes, metadata, unsafe globals.

    CKPT is a file (torch zip, legacy torch, TorchScript, safetensors, a pickle) or a folder (a shard
    index with its shards, a Hugging Face model folder). The format is found from the bytes. Nothing in
    the file is run: pickles are read by an unpickler that imports nothing; globals the file names are
    listed, and dangerous ones (os, subprocess, eval, …) make the exit code 1.

    With --model, the table gives a verdict per key (matched, missing, unexpected, shape mismatch, dtype
    differs), the summary says what share of the model a load would fill, and prints the exact
    `ckpt-doctor fix …` command that makes a strict load succeed. Exit 1 when a strict load would fail
    (after --allow-missing / --allow-unexpected / --min-loaded).

    \b
    ckpt-doctor inspect model.pth --model mypkg.nets:ResNet --model-arg num_classes=10
    ckpt-doctor inspect ft.pth --model nets.py:Net --allow-missing '^classifier\.'
    ckpt-doctor inspect new.pt --model old.pt --values      # compare two checkpoints

    The table goes to stdout, the summary to stderr.
    """
    from .modelspec import parse_model_args
    from .report import inspect_checkpoint

    if model_args and not model_spec:
        raise UsageError("--model-arg needs --model")
    report = inspect_checkpoint(ckpt, stats=stats, filter=filter_, model=model_spec,
                                model_args=parse_model_args(model_args), allow_missing=allow_missing,
                                allow_unexpected=allow_unexpected, min_loaded=min_loaded, values=values)
    if as_json:
        from .render.json_out import dumps, inspect_json

        click.echo(dumps(inspect_json(report)))
    else:
        from .render.table import inspect_summary, inspect_table

        click.echo(inspect_table(report, full=full))
        for line in inspect_summary(report, full=full):
            say(line, color="red" if line.startswith(("UNSAFE", "values", "batchnorm", "verdict  strict load F"))
                else None,
                no_color=no_color)
    if report.checkpoint.unsafe_globals and not as_json:
        say(f"{len(report.checkpoint.unsafe_globals)} dangerous global(s): never load this file with "
            "weights_only=False", color="red", no_color=no_color)
    return 1 if report.has_problems else 0
