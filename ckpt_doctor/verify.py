"""Proves a checkpoint runs: strict load, then the model alone, under DataParallel and under DDP."""

from __future__ import annotations

import enum
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from ._ddp_worker import RankJob, RankResult, run_rank, user_frame, write_job
from ._record import asdict, field, record, replace
from .compare import compare_checkpoint
from .default_load import default_load
from .errors import ModelSpecError, ReadError, UsageError, VerifyError, one_line, percent
from .loader import load_into
from .modelspec import example_inputs, library_names, model_keys, resolve_attr, resolve_spec, spec_flags
from .outputs import Tolerance, compare_outputs, flat_outputs
from .readers import read_checkpoint
from .readers.source import is_url, real_url
from .safepickle.policy import DEFAULT_POLICY, Policy


class Mode(str, enum.Enum):
    SINGLE = "single"
    DP = "dp"
    DDP = "ddp"


class Status(str, enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    SKIPPED = "skipped"


@record
class RunResult:
    mode: Mode
    world_size: int
    backend: str
    devices: tuple[str, ...]
    status: Status
    max_abs_diff: float | None
    seconds: float
    detail: str
    peak_memory: dict[str, int] = field(default_factory=dict)  # "cuda:0" (allocated) or "cpu" (RSS) -> peak bytes
    rtol: float | None = None  # the tolerance its outputs were compared with
    atol: float | None = None
    ranks: tuple[Any, ...] = ()  # DDP: each rank's RankResult


@record
class ModuleRow:
    name: str
    kind: str
    output_shape: str
    params: int


@record
class VerifyReport:
    """What verify found. `problems` is the one value its words and its exit code come from."""

    checkpoint: str
    model: str
    runs: tuple[RunResult, ...]
    comparison: Any = None  # the load's verdict (allowances and --min-loaded applied); nothing runs unless .ok
    summary: tuple[ModuleRow, ...] = ()
    first_difference: str | None = None  # with compared_to: the first module whose output differs
    allow_skip: bool = False
    compared_to: str | None = None
    tolerance: Tolerance = Tolerance()
    compare_model: str | None = None  # the model compared_to ran in; None: this model
    lazy: tuple[str, ...] = ()  # lazy modules whose parameters a first forward on the inputs created
    torch_load: str = ""  # why torch.load(path) with its defaults refuses the file here ("" where it loads it)

    @property
    def refused(self) -> bool:
        """The load's verdict stopped verify before anything ran."""
        return self.comparison is not None and not self.comparison.ok

    @property
    def loaded_fraction(self) -> float | None:
        """The share of the model's parameters (by elements, a tied Parameter once) the checkpoint filled."""
        return None if self.comparison is None else self.comparison.loaded_fraction

    @property
    def required_fraction(self) -> float | None:
        """The share the load had to fill: the comparison's rule (--min-loaded, or its default)."""
        c = self.comparison
        if c is None:
            return None
        required = getattr(c, "required_fraction", None)  # compare.py's default rule, where it has one
        if callable(required):
            required = required()
        return c.min_loaded if required is None else required

    @property
    def problems(self) -> tuple[str, ...]:
        """Why verify did not pass, one short clause each; empty when it passed."""
        c = self.comparison
        if self.refused:
            if not c.strict_ok:
                return ("the strict load failed: nothing was run",)
            required = self.required_fraction
            return (f"only {percent(c.loaded_fraction)} of the model's parameters came from the checkpoint"
                    + (f" ({percent(required)} required)" if required is not None else "") + ": nothing was run",)
        out = []
        failed = [r.mode.value for r in self.runs if r.status is Status.FAIL]
        if failed:
            out.append(f"failed: {', '.join(failed)}")
        if self.first_difference is not None:
            out.append(f"outputs differ from {self.compared_to}'s, first at {self.first_difference.split(' (')[0]}")
        skipped = self.skipped
        if skipped and not self.allow_skip:
            out.append(f"skipped for lack of hardware: {', '.join(skipped)} (pass --allow-skip to accept that)")
        if not self.runs:
            out.append("nothing was run")
        return tuple(out)

    @property
    def skipped(self) -> tuple[str, ...]:
        return tuple(r.mode.value for r in self.runs if r.status is Status.SKIPPED)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1


@record
class InputSpec:
    shapes: tuple[tuple[int, ...], ...] = ()
    dtype: str = "float32"
    low: int = 0
    high: int = 100
    function: str | None = None  # module:function returning the inputs
    seed: int = 0


def parse_shape(text: str) -> tuple[int, ...]:
    parts = [x.strip() for x in text.replace("x", ",").split(",")]
    shape = tuple(int(x) for x in parts) if all(x.isdigit() for x in parts) else ()
    if not shape or any(s <= 0 for s in shape):
        raise UsageError(f"--input-shape {text!r}: expected positive sizes like 8,3,32,32")
    return shape


def parse_modes(text: str) -> tuple[Mode, ...]:
    modes = []
    for part in text.split(","):
        try:
            modes.append(Mode(part.strip()))
        except ValueError:
            raise UsageError(f"--mode {text!r}: choose from single, dp, ddp (comma separated)") from None
    return tuple(dict.fromkeys(modes))


def make_inputs(spec: InputSpec, model_spec: str | None = None,
                model_args: dict[str, Any] | None = None) -> tuple[Any, ...]:
    """The inputs --input-shape or --input give; without either, those the model's SPEC says it takes (a Hugging
    Face config: token ids within its vocabulary, images of its size)."""
    import torch

    if not spec.shapes and not spec.function and model_spec is not None:
        made = example_inputs(model_spec, model_args, spec.seed)
        if made is not None:
            return made
    if spec.function:
        try:
            produced = resolve_attr(spec.function)()
        except ModelSpecError as exc:  # resolve_attr speaks of --model: here it is --input's function
            raise UsageError(str(exc).replace("--model", "--input", 1)) from None
        return tuple(produced) if isinstance(produced, (tuple, list)) else (produced,)
    if not spec.shapes:
        raise UsageError("give the model an input: --input-shape 8,3,32,32 (repeatable) or --input module:function")
    generator = torch.Generator().manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    if dtype.is_complex or dtype.itemsize > 8:
        raise UsageError(f"--input-dtype {spec.dtype}: generated inputs are real numbers (float*, bfloat16) or "
                         "integers (int*, uint8, bool); give other inputs with --input module:function")
    out = []
    for shape in spec.shapes:
        try:
            if dtype.is_floating_point:
                out.append(torch.randn(shape, generator=generator).to(dtype))
            elif dtype == torch.bool:
                out.append(torch.randint(0, 2, shape, generator=generator).bool())
            else:
                out.append(torch.randint(spec.low, spec.high, shape, generator=generator, dtype=dtype))
        except (RuntimeError, MemoryError, OverflowError) as exc:  # a shape no memory holds, a range the dtype lacks
            raise UsageError(f"--input-shape {','.join(map(str, shape))} ({spec.dtype}): cannot be made here: "
                             f"{one_line(exc, 160)}") from None
    return tuple(out)


def cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _to(inputs: tuple[Any, ...], device: Any) -> tuple[Any, ...]:
    return tuple(x.to(device) if hasattr(x, "to") else x for x in inputs)


def _peak(devices: list[int]) -> dict[str, int]:
    """The CUDA devices' peak allocations; on the CPU, this process's peak RSS."""
    import torch

    if not devices:
        import resource

        return {"cpu": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    return {f"cuda:{d}": int(torch.cuda.max_memory_allocated(d)) for d in devices}


def _reset_peak(devices: list[int]) -> None:
    import torch

    if devices:  # the allocator's statistics exist once CUDA is initialised: resetting them before that raises
        torch.cuda.init()  # "Invalid device argument" (a fresh `ckpt-doctor verify` on a GPU machine did)
    for d in devices:
        torch.cuda.reset_peak_memory_stats(d)


def run_single(model: Any, inputs: tuple[Any, ...], device: str) -> tuple[RunResult, list[Any]]:
    import torch

    start = time.perf_counter()
    cuda = [int(device.split(":")[1])] if device.startswith("cuda") else []
    if cuda:
        _reset_peak(cuda)
    model = model.to(device).eval()
    try:
        with torch.no_grad():
            out = flat_outputs(model(*_to(inputs, device)))
    except Exception as exc:  # the user's forward can raise anything; it is this run's verdict, not a crash
        message = one_line(str(exc).strip().splitlines()[0]) if str(exc).strip() else ""
        return RunResult(Mode.SINGLE, 1, "-", (device,), Status.FAIL, None, time.perf_counter() - start,
                         f"forward failed: {type(exc).__name__}: {message}"
                         + (f" (at {user_frame(exc)})" if user_frame(exc) else "")
                         + " (check --input-shape, or give the inputs with --input module:function)"), []
    elapsed = time.perf_counter() - start
    if not out:
        return RunResult(Mode.SINGLE, 1, "-", (device,), Status.FAIL, None, elapsed,
                         "the model returned no tensor"), []
    bad = [i for i, t in enumerate(out) if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        return RunResult(Mode.SINGLE, 1, "-", (device,), Status.FAIL, None, elapsed,
                         f"output {bad[0]} holds NaN/Inf: a weight or a BatchNorm statistic is corrupt "
                         "(inspect --stats shows which)", _peak(cuda)), out
    shapes = ", ".join(str(list(t.shape)) for t in out[:3])
    return RunResult(Mode.SINGLE, 1, "-", (device,), Status.PASS, 0.0, elapsed, f"eval forward, output {shapes}",
                     _peak(cuda)), [t.detach().cpu() for t in out]


def _unrepeatable(model: Any, inputs: tuple[Any, ...], reference: list[Any], tolerance: Tolerance) -> str:
    """Why a second run differs when it is the model's own doing: its forward on the same input, called again
    alone, gives other outputs (it keeps state between calls: an RNN's hidden state, a counter)."""
    import torch

    try:
        with torch.no_grad():
            again = flat_outputs(model.cpu().eval()(*inputs))
    except Exception:  # the forward ran once already: a second failure says nothing new
        return ""
    if compare_outputs(again, reference, tolerance).ok:
        return ""
    return ("; the model's own forward, called again on the same input, differs too: it keeps state between calls "
            "(an RNN's hidden state kept on the module, a counter), which no wrapper can make repeatable")


def _gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def run_dp(model: Any, inputs: tuple[Any, ...], reference: list[Any], gpus: int,
           tolerance: Tolerance = Tolerance()) -> RunResult:
    import torch

    start = time.perf_counter()
    have = cuda_count()
    if have == 0:
        wrapped = torch.nn.DataParallel(model.cpu().eval())
        with torch.no_grad():
            out = flat_outputs(wrapped(*inputs))
        diff = compare_outputs(out, reference, tolerance)
        status = Status.SKIPPED if diff.ok else Status.FAIL
        why = "" if diff.ok else _unrepeatable(model, inputs, reference, tolerance)
        outputs = "match" if diff.ok else f"DIFFER: {diff.detail}{why}"
        detail = (f"no CUDA device: ran nn.DataParallel on the CPU, where it only calls the model (outputs "
                  f"{outputs}); a {gpus}-GPU run needs {_gpus(gpus)}")
        return RunResult(Mode.DP, 1, "-", ("cpu",), status, diff.max_abs_diff, time.perf_counter() - start, detail,
                         _peak([]), diff.rtol, diff.atol)
    used = list(range(min(gpus, have)))
    _reset_peak(used)
    wrapped = torch.nn.DataParallel(model.to(f"cuda:{used[0]}").eval(), device_ids=used)
    with torch.no_grad():
        out = flat_outputs(wrapped(*_to(inputs, f"cuda:{used[0]}")))
    diff = compare_outputs(out, reference, tolerance, split=len(used) > 1)
    elapsed = time.perf_counter() - start
    devices = tuple(f"cuda:{d}" for d in used)
    if not diff.ok:
        return RunResult(Mode.DP, len(used), "-", devices, Status.FAIL, diff.max_abs_diff, elapsed,
                         f"outputs differ from single: {diff.describe()}; {diff.detail}"
                         f"{_unrepeatable(model, inputs, reference, tolerance)}", _peak(used), diff.rtol,
                         diff.atol)
    if len(used) < gpus:
        return RunResult(Mode.DP, len(used), "-", devices, Status.SKIPPED, diff.max_abs_diff, elapsed,
                         f"needs {gpus} CUDA devices, found {have}: ran DataParallel on {', '.join(devices)} only "
                         f"(outputs match single: {diff.describe()})", _peak(used), diff.rtol, diff.atol)
    return RunResult(Mode.DP, len(used), "-", devices, Status.PASS, diff.max_abs_diff, elapsed,
                     f"scatter/gather over {_gpus(len(used))} matches single ({diff.describe()})", _peak(used),
                     diff.rtol, diff.atol)


def run_ddp(job: RankJob, inputs: tuple[Any, ...], reference: list[Any], timeout: float,
            progress: Progress | None = None) -> RunResult:
    """Spawn the job's ranks (nccl on as many GPUs, else gloo on the CPU); each reports a RankResult as JSON."""
    import torch

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ckpt-doctor-ddp-") as tmp:
        folder = Path(tmp)
        torch.save({"inputs": list(inputs), "reference": reference}, folder / "io.pt")
        write_job(folder, job)
        port = _free_port()
        procs = []
        for rank in range(job.world_size):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(job.world_size), LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                       CKPT_DOCTOR_DDP_JOB=str(folder))
            procs.append(subprocess.Popen([sys.executable, "-m", "ckpt_doctor._ddp_worker"], env=env,
                                          stdout=subprocess.DEVNULL, stderr=open(folder / f"rank{rank}.log", "wb"),
                                          start_new_session=True))
        if progress:
            progress(f"ddp: {job.world_size} ranks ({job.backend}) started …")

        def ended(rank: int, code: int) -> None:
            if progress:
                path = folder / f"rank{rank}.json"
                status = json.loads(path.read_text()).get("status", "fail") if path.exists() else \
                    f"fail: exit code {code}"
                progress(f"ddp: rank {rank} done ({status})")

        failed = _wait(procs, timeout, ended)
        results = [_rank_result(folder, r, p, failed) for r, p in enumerate(procs)]
    return ddp_outcome(results, job.backend, inputs[0].shape[0], time.perf_counter() - start)


def ddp_outcome(results: list[RankResult], backend: str, batch: int, elapsed: float,
                launcher: str | None = None) -> RunResult:
    """The DDP run's verdict from its ranks' records: a rank that failed on its own comes first (its peers'
    closed connections are only the echo), with its exception and the model line that raised."""
    world = len(results)
    have = cuda_count()
    devices = tuple(r.device for r in results)
    errors = sorted((r for r in results if r.status != "pass"), key=lambda r: (not r.root_cause, r.rank))
    diff = max((r.max_abs_diff or 0.0 for r in results), default=0.0)
    rtol = max((r.rtol for r in results if r.rtol is not None), default=None)
    atol = max((r.atol for r in results if r.atol is not None), default=None)
    peak = {(r.device if backend == "nccl" else f"rank {r.rank} (RSS)"): r.peak_memory for r in results
            if r.peak_memory}
    where = launcher or (f"gloo on the CPU ({have} CUDA device{'s' if have != 1 else ''} here, {world} needed for "
                         "nccl)" if backend == "gloo" else f"nccl on {_gpus(world)}")
    sizes = sorted({len(r.samples) for r in results if r.samples})
    split = ""
    if batch % world:
        split = (f"; batch {batch} split as DistributedSampler does: {sizes[-1] if sizes else '?'} samples per rank, "
                 f"{-(-batch // world) * world - batch} repeated")
    if errors:
        first = errors[0]
        at = f" (at {first.where})" if first.where else ""
        others = [str(r.rank) for r in errors[1:] if r.root_cause]  # a rank its peer's failure stopped is no news
        also = f" (also: rank {', '.join(others)} failed)" if others else ""
        return RunResult(Mode.DDP, world, backend, devices, Status.FAIL, diff, elapsed,
                         f"rank {first.rank}: {first.error or 'failed'}{at}{also}", peak, rtol, atol, tuple(results))
    tol = f" within rtol {rtol:.3g}, atol {atol:.3g}" if rtol is not None and atol is not None else ""
    return RunResult(Mode.DDP, world, backend, devices, Status.PASS, diff, elapsed,
                     f"{where}: shard outputs match single{tol}{split}; one backward + SGD step, replicas identical, "
                     "state_dict round-trip exact", peak, rtol, atol, tuple(results))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(procs: list[subprocess.Popen], timeout: float,
          ended: Callable[[int, int], None] | None = None) -> dict[int, str]:
    """Wait for every rank; a crash stops the others at once, a deadline kills all. Returns rank -> reason.
    `ended(rank, exit code)` is called as each rank leaves on its own."""
    deadline = time.monotonic() + timeout
    reasons: dict[int, str] = {}
    seen: set[int] = set()
    while True:
        codes = [p.poll() for p in procs]
        for r, c in enumerate(codes):
            if c is not None and r not in seen:
                seen.add(r)
                if ended:
                    ended(r, c)
        if all(c is not None for c in codes):
            break
        crashed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if crashed or time.monotonic() > deadline:
            for r, c in enumerate(codes):
                if c is None:
                    reasons[r] = (f"still running after the timeout ({timeout:g} s): hung" if not crashed
                                  else f"stopped because rank {crashed[0]} failed")
            break
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()
    return reasons


def _rank_result(folder: Path, rank: int, proc: subprocess.Popen, reasons: dict[int, str]) -> RankResult:
    path = folder / f"rank{rank}.json"
    if path.exists():
        result = RankResult.from_json(json.loads(path.read_text()))
        if proc.returncode == 0 or result.status == "fail":
            return result
    if rank in reasons:
        return RankResult(rank, error=reasons[rank], root_cause="hung" in reasons[rank])
    code = proc.returncode
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with {code}"
    log = (folder / f"rank{rank}.log").read_text(errors="replace").strip().splitlines()
    last = next((line for line in reversed(log) if line.strip()), "")
    return RankResult(rank, error=how + (f": {last[-200:]}" if last else ""))


def _run_with_leaf_hooks(model: Any, inputs: tuple[Any, ...], on_output: Callable[[str, Any, Any], None]) -> Any:
    """One eval forward, calling on_output(name, module, output) for every leaf module in execution order; returns
    the forward's result."""
    import torch

    hooks = [module.register_forward_hook(lambda mod, args, out, name=name: on_output(name, mod, out))
             for name, module in model.named_modules() if name and not list(module.children())]
    try:
        with torch.no_grad():
            return model.eval()(*inputs)
    finally:
        for h in hooks:
            h.remove()


def module_summary(model: Any, inputs: tuple[Any, ...]) -> list[ModuleRow]:
    """Each leaf module's output shape and parameter count, in execution order (like torchsummary)."""
    rows: list[ModuleRow] = []

    def record(name: str, mod: Any, out: Any) -> None:
        shapes = [list(t.shape) for t in flat_outputs(out)]
        rows.append(ModuleRow(name, type(mod).__name__, str(shapes[0] if len(shapes) == 1 else shapes),
                              sum(p.numel() for p in mod.parameters(recurse=False))))

    _run_with_leaf_hooks(model, inputs, record)
    return rows


def first_difference(model_a: Any, model_b: Any, inputs: tuple[Any, ...],
                     tolerance: Tolerance = Tolerance()) -> str | None:
    """The first leaf module (in execution order) whose output differs between two loaded models (assert_close's
    rule, at the default tolerance of each output's dtype: the same batch, the same kernels); then the models'
    final outputs. The models may be two classes (a checkpoint mapped by order, and the original in its own
    model): leaf modules are paired by the order they run in, and the other's name is given where it differs."""

    def outputs(model: Any) -> tuple[list[tuple[str, list[Any]]], list[Any]]:
        seen: list[tuple[str, list[Any]]] = []
        final = _run_with_leaf_hooks(model, inputs, lambda name, mod, out: seen.append(
            (name, [t.detach().clone() for t in flat_outputs(out)])))
        return seen, [t.detach() for t in flat_outputs(final)]

    (leaves_a, final_a), (leaves_b, final_b) = outputs(model_a), outputs(model_b)
    for (name, a), (other, b) in zip(leaves_a, leaves_b):
        diff = compare_outputs(a, b, tolerance)
        if not diff.ok:
            return f"{name}{'' if other == name else f' (paired with {other})'} ({_how(diff)})"
    diff = compare_outputs(final_a, final_b, tolerance)
    if not diff.ok:
        return f"the model's output ({_how(diff)})"
    return None


def _how(diff: Any) -> str:
    return diff.describe() if diff.max_abs_diff != float("inf") else diff.detail


Progress = Callable[[str], None]  # a line for the person at the terminal (the CLI passes one only on a tty)

SEED = 0


@record
class _Prepared:
    comparison: Any
    model: Any
    inputs: tuple[Any, ...]
    lazy: tuple[str, ...]
    torch_load: str = ""  # VerifyReport's


def _prepare(ckpt: str, model_spec: str, model_args: dict[str, Any], inputs_spec: InputSpec, select: str | None,
             allow_missing: str | None, allow_unexpected: str | None, min_loaded: float | None,
             policy: Policy = DEFAULT_POLICY) -> _Prepared:
    """The inputs, the model built on the CPU (lazy modules created by a forward on them), the load's verdict,
    and, when that verdict lets anything run, the model loaded: the same in every process that verifies."""
    checkpoint = _read_safe(ckpt, policy)  # judged before torch loads: code is refused in a moment
    loads = default_load(checkpoint)
    import torch

    torch.manual_seed(SEED)  # an --input function drawing from torch's generator draws the same batch every time
    inputs = make_inputs(inputs_spec, model_spec, model_args)
    model, lazy = _build(model_spec, model_args, inputs)
    # Saved devices this machine lacks are no obstacle here: every run maps them to its own device.
    keys = replace(model_keys(model, model_spec), flags=spec_flags(model_spec, model_args),
                   load_name=library_names(model_spec, model))
    comparison = replace(compare_checkpoint(checkpoint, keys, select=select, allow_missing=allow_missing,
                                            allow_unexpected=allow_unexpected, min_loaded=min_loaded),
                         missing_devices=())
    if comparison.ok:  # the file as it is: tied names filled, what the allowances accept kept from the model
        load_into(model, ckpt, fix=None, device="cpu", select=select, allow_missing=allow_missing,
                  allow_unexpected=allow_unexpected, policy=policy)
    return _Prepared(comparison, model, inputs, lazy, "" if loads.ok else "; ".join(loads.reasons()))


def _read_safe(ckpt: str, policy: Policy = DEFAULT_POLICY) -> Any:
    """The checkpoint read under `policy`, refused (exit 1) when loading it would run code, with the rescue to run
    instead."""

    checkpoint = read_checkpoint(ckpt, policy=policy)
    if checkpoint.unsafe_globals or checkpoint.hazards:
        from .fix.rescue import rescue  # the fix planner: only for a file that would run code

        found = rescue(checkpoint, policy=policy)
        checkpoint.refuse_if_unsafe("verify it — nothing from it was loaded or run",
                                    f"Rescue its weights first with `{found.command}`, then verify {found.argv[3]}"
                                    if found is not None else "")
    return checkpoint


def _build(spec: str, args: dict[str, Any], inputs: tuple[Any, ...]) -> tuple[Any, tuple[str, ...]]:
    """The model on the CPU, built after SEED as every rank builds it (keys a file lacks start equal everywhere),
    its lazy modules created by one forward on the inputs."""
    import torch

    from .modelspec import build_model, materialize_lazy

    torch.manual_seed(SEED)
    model = build_model(spec, args, "cpu")
    return model, materialize_lazy(model, inputs, spec)


def verify(ckpt: str, model_spec: str, model_args: dict[str, Any], inputs_spec: InputSpec, gpus: int = 2,
           modes: tuple[Mode, ...] = (Mode.SINGLE, Mode.DP, Mode.DDP), timeout: float = 300.0,
           summary: bool = False, compare_to: str | None = None, allow_skip: bool = False,
           select: str | None = None, allow_missing: str | None = None, allow_unexpected: str | None = None,
           tolerance: Tolerance = Tolerance(), *, min_loaded: float | None = None, compare_model: str | None = None,
           compare_model_args: dict[str, Any] | None = None, progress: Progress | None = None,
           policy: Policy = DEFAULT_POLICY) -> VerifyReport:
    """The load's verdict (allowances and --min-loaded applied), then the runs asked for. `compare_to` runs in
    `compare_model` when given (the original of a checkpoint mapped by order, in its own model), else in this
    model, loaded with the fix `inspect --model` infers for it (the file a checkpoint was repaired from). The files
    are read under `policy` here (each DDP rank, a process of its own, reads with the defaults)."""
    if gpus < 1:
        raise UsageError("--gpus must be at least 1")
    _check_compare_flags(compare_to, compare_model, compare_model_args)
    model_spec, compare_model = _resolved(model_spec, ckpt, compare_model, compare_to)
    prepared = _prepare(ckpt, model_spec, model_args, inputs_spec, select, allow_missing, allow_unexpected,
                        min_loaded, policy)
    import torch

    comparison, model, inputs = prepared.comparison, prepared.model, prepared.inputs
    if not comparison.ok:
        return VerifyReport(ckpt, model_spec, (), comparison, allow_skip=allow_skip, lazy=prepared.lazy,
                            torch_load=prepared.torch_load)
    device = "cuda:0" if cuda_count() else "cpu"
    runs: list[RunResult] = []
    if progress:
        progress(f"single: running the eval forward on {device} …")
    single, reference = run_single(model, inputs, device)
    if Mode.SINGLE in modes or single.status is Status.FAIL:
        runs.append(single)
    model = model.cpu()
    rows: tuple[ModuleRow, ...] = ()
    if summary:
        rows = tuple(module_summary(model, inputs))
    diff_at = None
    if compare_to:
        if progress:
            progress(f"compare: running {compare_to} in {compare_model or model_spec} …")
        other = load_reference(compare_to, compare_model or model_spec,
                               model_args if compare_model is None else (compare_model_args or {}), inputs,
                               own_model=compare_model is not None, allow_missing=allow_missing,
                               allow_unexpected=allow_unexpected, policy=policy)
        diff_at = first_difference(model, other, inputs, tolerance)
    if single.status is Status.PASS:
        if Mode.DP in modes:
            if progress:
                progress(f"dp: running nn.DataParallel over {_gpus(min(gpus, cuda_count()))} …" if cuda_count() else
                         "dp: no CUDA device: running nn.DataParallel on the CPU …")
            runs.append(run_dp(model, inputs, reference, gpus, tolerance))
        if Mode.DDP in modes:
            backend = "nccl" if cuda_count() >= gpus and torch.distributed.is_nccl_available() else "gloo"
            job = RankJob(_job_path(ckpt), model_spec, {k: repr(v) for k, v in model_args.items()},
                          backend, gpus, os.getcwd(), select, allow_missing, allow_unexpected, tolerance.rtol,
                          tolerance.atol, SEED)
            runs.append(run_ddp(job, inputs, reference, timeout, progress))
    return VerifyReport(ckpt, model_spec, tuple(runs), comparison, rows, diff_at, allow_skip, compare_to, tolerance,
                        compare_model, prepared.lazy, prepared.torch_load)


def _check_compare_flags(compare_to: str | None, compare_model: str | None,
                         compare_model_args: dict[str, Any] | None) -> None:
    if compare_model and not compare_to:
        raise UsageError("--compare-model names the model of the checkpoint given with --compare-to: add "
                         "--compare-to ORIGINAL_CKPT")
    if compare_model_args and not compare_model:
        raise UsageError("--compare-model-arg needs --compare-model")


def _resolved(model_spec: str, ckpt: str, compare_model: str | None,
              compare_to: str | None) -> tuple[str, str | None]:
    """Each SPEC with what it leaves to its checkpoint filled in (`hf:` alone: the config.json beside it), so that
    the ranks and the report name the same model."""
    return resolve_spec(model_spec, ckpt), None if compare_model is None else resolve_spec(compare_model, compare_to)


def load_reference(path: str, spec: str, args: dict[str, Any], inputs: tuple[Any, ...], *, own_model: bool,
                   allow_missing: str | None = None, allow_unexpected: str | None = None,
                   policy: Policy = DEFAULT_POLICY) -> Any:
    """The checkpoint `--compare-to` names, loaded on the CPU into a model of `spec`: its own model (`own_model`,
    from --compare-model: loaded with the fix inspect infers, nothing accepted) or the verified one (the fix
    inspect infers and the allowances given). A file that does not load so is refused in one line that says
    which flag to use."""
    checkpoint = read_checkpoint(path, policy=policy)  # an unreadable file is its own error, raised as such
    checkpoint.refuse_if_unsafe("load it for --compare-to — nothing from it was loaded or run")
    model, _ = _build(spec, args, inputs)
    if own_model:
        allow_missing = allow_unexpected = None
    try:
        load_into(model, path, fix="auto", device="cpu", allow_missing=allow_missing,
                  allow_unexpected=allow_unexpected, policy=policy)
    except ReadError:
        c = compare_checkpoint(checkpoint, model_keys(model, spec), allow_missing=allow_missing,
                               allow_unexpected=allow_unexpected)
        what = _load_problems(c)
        if own_model:
            raise VerifyError(f"--compare-to {path} does not load into {type(model).__name__} (--compare-model "
                              f"{spec}): {what}; --compare-to names the checkpoint of the --compare-model") from None
        order = "; names differ where shapes agree, as in a mapping by order" if c.fix_kind == "map-by-order" else ""
        raise VerifyError(f"--compare-to {path} does not load into {type(model).__name__}, even with the renames "
                          f"inspect --model infers: {what}{order}. To compare with a checkpoint of another model, "
                          "add --compare-model with that model's SPEC; for intended differences, --allow-missing / "
                          "--allow-unexpected") from None
    return model


def _load_problems(c: Any) -> str:
    """What a strict load of the file says, counted, with the first key of each kind."""
    parts = []
    for label, keys in (("missing", c.missing), ("unexpected", c.unexpected),
                        ("of another shape", [m.key for m in c.mismatched])):
        if keys:
            parts.append(f"{len(keys)} {label} (first: {keys[0]})")
    if c.errors:
        parts.append(f"the model's loading code: {c.errors[0][:200]}")
    return ", ".join(parts) or "the load failed"


def verify_under_torchrun(ckpt: str, model_spec: str, model_args: dict[str, Any], spec: InputSpec,
                          allow_skip: bool, select: str | None = None, allow_missing: str | None = None,
                          allow_unexpected: str | None = None, tolerance: Tolerance = Tolerance(), *,
                          min_loaded: float | None = None, timeout: float = 300.0, summary: bool = False,
                          compare_to: str | None = None, compare_model: str | None = None,
                          compare_model_args: dict[str, Any] | None = None,
                          progress: Progress | None = None, policy: Policy = DEFAULT_POLICY) -> VerifyReport | None:
    """Launched by torchrun: join its group, run this rank, and let rank 0 report for all (across nodes too).
    Every rank reaches the load's verdict on its own (the same one): a refused load runs nothing anywhere."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    _check_compare_flags(compare_to, compare_model, compare_model_args)
    model_spec, compare_model = _resolved(model_spec, ckpt, compare_model, compare_to)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", 0))
    # Every rank must pick the same backend: nccl only when this node has a GPU for each of its ranks (two ranks on
    # one GPU would have rank 0 on nccl and rank 1 on gloo, and the group would never form).
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    backend = "nccl" if cuda_count() >= per_node and dist.is_nccl_available() else "gloo"
    prepared = _prepare(ckpt, model_spec, model_args, spec, select, allow_missing, allow_unexpected, min_loaded,
                        policy)
    if not prepared.comparison.ok:
        return VerifyReport(ckpt, model_spec, (), prepared.comparison, allow_skip=allow_skip,
                            lazy=prepared.lazy, torch_load=prepared.torch_load) if rank == 0 else None
    model, inputs = prepared.model, prepared.inputs
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(local)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))  # a rank left behind ends at --timeout
    try:
        single, reference = run_single(model, inputs, "cpu")
        start = time.perf_counter()
        job = RankJob(_job_path(ckpt), model_spec, {k: repr(v) for k, v in model_args.items()}, backend,
                      world, os.getcwd(), select, allow_missing, allow_unexpected, tolerance.rtol, tolerance.atol,
                      SEED)
        if progress and rank == 0:
            progress(f"ddp: joined torchrun's group ({backend}, {world} ranks) …")
        result = run_rank(job, list(inputs), reference)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, asdict(result))
        dist.barrier()  # nobody tears the group down while a peer still uses it (gloo aborts otherwise)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    results = [RankResult.from_json(r) for r in gathered]
    run = ddp_outcome(results, backend, inputs[0].shape[0], time.perf_counter() - start,
                      launcher=f"joined torchrun's group ({backend}, {world} ranks)")
    model = model.cpu()
    rows = tuple(module_summary(model, inputs)) if summary else ()
    diff_at = None
    if compare_to:
        other = load_reference(compare_to, compare_model or model_spec,
                               model_args if compare_model is None else (compare_model_args or {}), inputs,
                               own_model=compare_model is not None, allow_missing=allow_missing,
                               allow_unexpected=allow_unexpected, policy=policy)
        diff_at = first_difference(model, other, inputs, tolerance)
    return VerifyReport(ckpt, model_spec, (single, run), prepared.comparison, rows, diff_at, allow_skip, compare_to,
                        tolerance, compare_model, prepared.lazy, prepared.torch_load)


def _job_path(ckpt: Any) -> str:
    """The checkpoint as each rank opens it: a URL as given (each rank reads it by range requests), else absolute."""
    return real_url(ckpt) if is_url(ckpt) else str(Path(ckpt).resolve())


def check_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "CKPT_DOCTOR_DDP_JOB" not in os.environ
