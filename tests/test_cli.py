"""The command line through click's CliRunner and through the installed `ckpt-doctor` command: every table format
drawn by tabulate from the same rows, --json and --format json alike, usage errors as one line with exit 2,
--version, shell completion, and --help with its sections and examples."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from tabulate import tabulate

from ckpt_doctor.cli import main
from tests.conftest import ROOT

FORMATS = ("table", "github", "markdown", "grid", "tsv")


class Config:  # a class of this test module: torch.load(weights_only=False) would import and call it
    def __init__(self) -> None:
        self.depth = 3


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 6 * 6, 2))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("cli")
    net = _net()
    a, b = folder / "a.pt", folder / "b.pt"
    torch.save(net.state_dict(), a)
    with torch.no_grad():
        net[3].bias.add_(1.0)
    torch.save(net.state_dict(), b)
    unsafe = folder / "unsafe.pt"
    torch.save({"model": net.state_dict(), "config": Config()}, unsafe)
    return {"a": a, "b": b, "unsafe": unsafe, "keys": list(net.state_dict())}


def _commands(files: dict) -> dict[str, list[str]]:
    return {"inspect": ["inspect", str(files["a"]), "--full"], "scan": ["scan", str(files["unsafe"]), "--all"],
            "diff": ["diff", str(files["a"]), str(files["b"]), "--full"]}


def invoke(*args: str):
    """The command run in this process through click's CliRunner; its --allow-global is a value the command passes
    to the library (nothing to save and restore)."""
    return CliRunner().invoke(main, list(args))


def installed(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The console script pip installed, running this checkout's code."""
    exe = shutil.which("ckpt-doctor") or os.path.join(os.path.dirname(sys.executable), "ckpt-doctor")
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, env=env, check=False)


def _cells(tsv: str) -> tuple[list[str], list[list[str]]]:
    """Headers and rows back from a tsv table (tabulate pads tsv cells with blanks and trims a line's end, so empty
    cells at the end of a row are left out)."""
    lines = [[cell.strip() for cell in line.split("\t")] for line in tsv.splitlines()]
    return lines[0], [row + [""] * (len(lines[0]) - len(row)) for row in lines[1:]]


@pytest.mark.parametrize("command", ["inspect", "scan", "diff"])
def test_every_format_is_tabulates_table_of_the_same_rows(files, command):
    argv = _commands(files)[command]
    out = {fmt: invoke(*argv, "--format", fmt) for fmt in FORMATS}
    assert {r.exit_code for r in out.values()} == {1 if command in ("scan", "diff") else 0}, out["table"].stderr
    assert len({r.stderr for r in out.values()}) == 1  # the summary on stderr does not depend on the format
    headers, rows = _cells(out["tsv"].stdout)
    assert len(rows) > 1 and all(len(row) == len(headers) for row in rows)
    for fmt, tablefmt in (("table", "simple"), ("github", "github"), ("markdown", "github"), ("grid", "grid")):
        cells = [[c.replace("|", "\\|") for c in row] for row in [headers, *rows]] if tablefmt == "github" else \
            [headers, *rows]
        expected = tabulate(cells[1:], cells[0], tablefmt=tablefmt, disable_numparse=True)
        if fmt == "table" and max(map(len, expected.splitlines())) > 120:  # held to 120 columns: last column wrapped
            text = out[fmt].stdout
            assert max(map(len, text.splitlines())) <= 120
            assert all(" ".join(cell.split()) in " ".join(text.split()) for row in rows for cell in row)  # none lost
            continue
        assert out[fmt].stdout == expected + "\n", fmt
    if command == "inspect":  # --full: one row per tensor, as torch saved them
        assert [row[0] for row in rows] == files["keys"]
    elif command == "scan":
        assert rows[0][:4] == [str(files["unsafe"]), "CODE", f"{Config.__module__}.Config", "unsafe/data.pkl"]
        assert {row[1] for row in rows[1:]} == {"safe"}  # --all: the allow-listed globals too
    else:
        changed = {row[0] for row in rows if row[1] != "identical"}
        assert changed == {"3.bias"}, rows


def test_github_format_is_a_markdown_table(files):
    text = invoke("diff", str(files["a"]), str(files["b"]), "--format", "github").stdout
    lines = text.splitlines()
    assert lines[0].startswith("| key") and "max\\|Δ\\|" in lines[0]  # the header's bars escaped
    assert set(lines[1]) <= set("|-:") and all(line.startswith("|") and line.endswith("|") for line in lines)
    assert {line.count("|") - line.count("\\|") for line in lines} == {8}  # 7 cells in every row


def test_json_and_format_json_print_the_same_object(files):
    for argv in _commands(files).values():
        as_json, as_format = invoke(*argv, "--json"), invoke(*argv, "--format", "json")
        assert as_json.exit_code == as_format.exit_code and as_json.stdout == as_format.stdout
        json.loads(as_json.stdout)


def test_json_with_a_table_format_is_a_usage_error(files):
    result = invoke("inspect", str(files["a"]), "--json", "--format", "grid")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == "Error: --json and --format grid ask for two outputs; give one of them\n"


@pytest.mark.parametrize("argv, words", [
    (["verify", "x.pt", "--model", "m:f", "--gpus", "0"], "'0' is not 1 or more (see `ckpt-doctor verify --help`)"),
    (["inspect", "x.pt", "--min-loaded", "0"], "'0' is not more than 0 and at most 1"),
    (["diff", "a.pt", "b.pt", "--atol", "-1"], "'-1' is not a number, 0 or more"),
    (["verify", "x.pt", "--model", "m:f", "--timeout", "nan"], "'nan' is not a number more than 0"),
    (["inspect", ""], "an empty path names no file (use . for this folder)"),
    (["inspect", "x.pt", "--format", "html"], "'html' is not one of"),
    (["fix", "x.pt"], "Missing option '-o' / '--output'"),
    (["fix", "x.pt", "-o"], "Option '-o' requires an argument. (see `ckpt-doctor fix --help`)"),
    (["fix", "x.pt", "-o", "y.pt", "--format", "onnx"], "(see `ckpt-doctor fix --help`)"),
    (["inspect", "x.pt", "--no-such-flag"], "No such option"),
    (["frobnicate"], "No such command 'frobnicate'"),
    ([], "Error: name a command (inspect, fix, diff, verify, scan)"),
    # an option that needs a value never takes the next option as its value (--drop would drop nothing)
    (["fix", "x.pt", "-o", "y.pt", "--drop", "--strip-module"],
     "--drop needs a value, and the next word --strip-module is an option (a value that starts with '-' is written "
     "--drop=-value)"),
    (["inspect", "x.pt", "--filter", "--full"], "--filter needs a value, and the next word --full is an option"),
    (["inspect", "x.pt", "--model"], "requires an argument. (a value that starts with '-' is written --model=-value)"),
    (["inspect", "-weird.pt"], "(a path that starts with '-' goes after --, or is written ./-name)"),
    (["verify", "x.pt", "--model", "m:f", "--input-range", "5,1"], "LOW must be below HIGH"),
])
def test_usage_errors_exit_2_with_one_error_line(argv, words):
    result = invoke(*argv)
    assert result.exit_code == 2 and result.stdout == "", result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and words in errors[0], result.stderr
    assert "Traceback" not in result.stderr


def test_no_colour_when_stderr_is_no_terminal(files):
    result = invoke("scan", str(files["unsafe"]))
    assert result.exit_code == 1 and "CODE" in result.stdout and "would run code" in result.stderr
    assert "\x1b" not in result.stdout + result.stderr


def test_help_has_sections_and_keeps_the_examples_as_written():
    result = CliRunner().invoke(main, ["inspect", "--help"], terminal_width=60)
    text = result.stdout
    assert result.exit_code == 0
    for section in ("Arguments:", "Output:", "Against a model:", "Safety:", "Exit codes (every command):"):
        assert section in text
    # the examples are kept line for line, however narrow the terminal
    assert "  ckpt-doctor inspect new.pt --model old.pt --values      # compare two checkpoints\n" in text
    # lines break at blanks only: an option named in a sentence is never cut at its hyphens
    assert "--require-\n" not in text and "--require-default-load" in text
    group = CliRunner().invoke(main, ["--help"]).stdout
    assert [line.split()[0] for line in group.split("Commands:")[1].splitlines()[3:8]] == \
        ["inspect", "fix", "diff", "verify", "scan"]


def test_the_training_checkpoint_example_in_fix_help_drops_what_it_names(tmp_path):
    """The --drop of `fix --help`'s Lightning example runs after --select state_dict, so it must name state_dict keys:
    '^optimizer' there matched none (the optimizer is left out by --select), a flag that looked like it did work."""
    import shlex

    from tests.conftest import run_cli

    text = CliRunner().invoke(main, ["fix", "--help"], terminal_width=200).stdout
    line = next(ln.strip() for ln in text.splitlines() if ln.strip().startswith("ckpt-doctor fix train.ckpt"))
    argv = shlex.split(line)[2:]
    ckpt = tmp_path / "train.ckpt"  # as Lightning saves a module holding `model` and a loss with a weight
    torch.save({"state_dict": {"model.fc.weight": torch.ones(2, 2), "model.fc.bias": torch.zeros(2),
                               "criterion.weight": torch.ones(2)},
                "optimizer_states": [{"state": {}, "param_groups": []}], "epoch": 3}, ckpt)
    argv = [str(ckpt) if a == "train.ckpt" else str(tmp_path / a) if a == "model.pt" else a for a in argv]
    result = run_cli("fix", *argv, "--json")
    assert result.exit_code == 0, result.stderr
    assert set(torch.load(tmp_path / "model.pt")) == {"fc.weight", "fc.bias"}
    assert "criterion.weight" in result.json()["dropped"]


def test_help_wraps_to_the_terminal_width_in_columns():
    """--help reads the width as shutil.get_terminal_size does ($COLUMNS first, 80 without a terminal), without
    importing shutil: a narrow terminal gets narrow paragraphs, a wide one wide ones."""
    def lines(columns: str) -> list[str]:
        proc = subprocess.run([sys.executable, "-m", "ckpt_doctor", "inspect", "--help"], capture_output=True,
                              text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": columns},
                              check=True)
        return proc.stdout.splitlines()

    narrow, default, wide = lines("60"), lines("0"), lines("200")
    assert len(narrow) > len(default) > len(wide)
    assert sum(len(line) <= 58 for line in narrow) > 0.8 * len(narrow)


def test_version():
    assert invoke("--version").stdout == f"ckpt-doctor {__import__('ckpt_doctor').__version__}\n"


def test_the_installed_command_prints_what_the_runner_prints(files):
    for argv in _commands(files).values():
        for fmt in ("table", "github", "tsv"):
            proc = installed(*argv, "--format", fmt)
            runner = invoke(*argv, "--format", fmt)
            assert (proc.returncode, proc.stdout) == (runner.exit_code, runner.stdout), (argv, fmt, proc.stderr)
    version = installed("--version")
    assert version.returncode == 0 and version.stdout.startswith("ckpt-doctor ")
    bad = installed("inspect", str(files["a"]), "--format", "html")
    assert bad.returncode == 2 and bad.stderr.startswith("Error: ") and bad.stderr.count("\n") == 1


def test_shell_completion_through_clicks_own_mechanism(files):
    script = installed(env={"_CKPT_DOCTOR_COMPLETE": "bash_source"})
    assert script.returncode == 0 and "complete " in script.stdout and "_CKPT_DOCTOR_COMPLETE" in script.stdout

    def complete(words: str) -> list[str]:
        proc = installed(env={"_CKPT_DOCTOR_COMPLETE": "bash_complete", "COMP_WORDS": words,
                              "COMP_CWORD": str(len(words.split()) - (0 if words.endswith(" ") else 1))})
        assert proc.returncode == 0, proc.stderr
        return [line.split(",", 1)[1] for line in proc.stdout.splitlines()]

    assert complete("ckpt-doctor ins") == ["inspect"]
    assert complete("ckpt-doctor inspect a.pt --form") == ["--format"]
    assert complete("ckpt-doctor inspect a.pt --format ") == ["table", "json", "github", "markdown", "grid", "tsv"]


def test_tabulate_is_imported_only_for_a_table(files):
    """Start-up: tabulate is imported by a command that prints a table (the terminal's, github, grid, tsv), never for
    --json or --help; torch by none of them."""
    code = ("import sys\nfrom ckpt_doctor.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('tabulate' in sys.modules, 'torch' in sys.modules, file=sys.stderr)\n"
            "print('shutil' in sys.modules, file=sys.stderr)")
    for argv, imported in ((["--help"], "False False"), (["inspect", str(files["a"]), "--json"], "False False"),
                           (["inspect", str(files["a"])], "True False"),
                           (["inspect", str(files["a"]), "--format", "grid"], "True False")):
        proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
        assert proc.stderr.strip().splitlines()[-2] == imported, (argv, proc.stderr)
        if argv == ["--help"]:  # click's formatter would import shutil (and bz2, lzma) for the terminal's width
            assert proc.stderr.strip().splitlines()[-1] == "False", proc.stderr


def test_a_value_that_starts_with_a_dash_is_written_with_an_equals_sign(files, tmp_path):
    out = tmp_path / "out.pt"
    result = invoke("fix", str(files["a"]), "-o", str(out), "--drop=-nothing", "--dry-run")
    assert result.exit_code == 0 and "--drop -nothing" in result.stderr, result.stderr


def test_machine_formats_get_cells_as_they_are_and_a_table_even_when_empty(files):
    """tsv is for a program: no blanks around a cell; a filter that keeps nothing, a scan that finds nothing, still
    print the headers (the sentence a person reads goes to stderr with the summary)."""
    tsv = invoke("inspect", str(files["a"]), "--full", "--format", "tsv").stdout
    rows = [line.split("\t") for line in tsv.splitlines()]
    assert rows[0] == ["key", "shape", "dtype", "device", "size"]
    assert [row[0] for row in rows[1:]] == files["keys"] and all(c == c.strip() for row in rows for c in row)
    empty = invoke("inspect", str(files["a"]), "--filter", "nothing-matches", "--format", "tsv")
    assert empty.exit_code == 0 and empty.stdout == "key\tshape\tdtype\tdevice\tsize\n"
    clean = invoke("scan", str(files["a"]), "--format", "github")
    assert clean.exit_code == 0 and clean.stdout.splitlines()[0].split("|")[1].strip() == "file"
    assert len(clean.stdout.splitlines()) == 2 and "clean" in clean.stderr


def test_what_the_system_refuses_is_one_line_not_an_internal_error(files, tmp_path):
    long_name = str(tmp_path / ("a" * 300 + ".pt"))
    for argv in (["inspect", long_name], ["fix", str(files["a"]), "-o", long_name]):
        proc = installed(*argv)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith("Error: ") and "File name too long" in proc.stderr
        assert "internal error" not in proc.stderr
    exe = shutil.which("ckpt-doctor") or os.path.join(os.path.dirname(sys.executable), "ckpt-doctor")
    closed = subprocess.run([exe, "inspect", str(files["a"])], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False,
                            preexec_fn=lambda: os.close(1))
    assert closed.returncode == 2 and closed.stderr.startswith("Error: stdout is closed"), closed.stderr
    with open("/dev/full", "w") as full:
        proc = subprocess.run([exe, "inspect", str(files["a"])], stdout=full, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    assert proc.returncode == 2 and "No space left on device" in proc.stderr and "internal" not in proc.stderr


def test_scan_says_which_files_it_could_not_read_when_they_decide_the_exit(files, tmp_path):
    cut = tmp_path / "cut.pt"
    cut.write_bytes(files["a"].read_bytes()[:300])
    result = invoke("scan", str(files["a"]), str(cut))
    assert result.exit_code == 2
    assert f"{cut}: NOT READ" in result.stderr
    assert "Error: 1 file(s) could not be read: nothing is claimed about them" in result.stderr
