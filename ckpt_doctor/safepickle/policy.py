"""The one policy table: which globals a pickle may name, and the verdict — safe, code or dangerous — for the rest.

A global is acceptable only if it is allowed: torch's own `weights_only` allow-list, a short curated list of inert
data records of the formats ckpt-doctor reads (each with the reason it cannot run code), or a name the user adds
(`--allow-global`, like `torch.serialization.add_safe_globals`). Everything else is a finding: "dangerous" when it
is known to run commands, evaluate text, touch files or the network, or unpickle more data; otherwise "code" — a
class or function that `torch.load(weights_only=False)` would import and call. Nothing named here is ever imported.

The static walker and the safe unpickler both ask the `Policy` they are handed; nothing else decides. A Policy is
an immutable value built once per command (the defaults and `--allow-global`) and passed down: no policy is "in
force", and nothing here changes after import.
"""

from __future__ import annotations

import enum
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from .._record import record

from ..errors import UsageError

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only: importing typing costs every start ~2.5 ms
    from typing import Iterable


class Verdict(str, enum.Enum):
    """What a global a pickle names would do under `torch.load(weights_only=False)`. None is ever imported here."""

    SAFE = "safe"  # on the allow-list
    CODE = "code"  # would be imported and called: a user class, a whole model, an unknown callable
    DANGEROUS = "dangerous"  # known to run commands, evaluate text, touch files or the network, unpickle more

    @property
    def rank(self) -> int:
        return _RANK[self]


_RANK = {Verdict.SAFE: 0, Verdict.CODE: 1, Verdict.DANGEROUS: 2}


@record
class GlobalRef:
    """A global a pickle names, as the pickle spells it, with the verdict on what it resolves to."""

    module: str
    name: str
    verdict: Verdict
    reason: str = ""
    source: str = ""  # where it is named: `archive/data.pkl`, `pickle 4 (object)`, `… → nested pickle`

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


# --- torch's weights_only allow-list (torch 2.13, `torch._weights_only_unpickler._get_allowed_globals`) ----------
# tests/test_policy.py checks this table against the installed torch's own list.

_DTYPES = (
    "bfloat16 bits16 bits1x8 bits2x4 bits4x2 bits8 bool complex128 complex32 complex64 float16 float32 "
    "float4_e2m1fn_x2 float64 float8_e4m3fn float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz float8_e8m0fnu "
    "int1 int16 int2 int3 int32 int4 int5 int6 int64 int7 int8 qint32 qint8 quint2x4 quint4x2 quint8 "
    "uint1 uint16 uint2 uint3 uint32 uint4 uint5 uint6 uint64 uint7 uint8").split()
TORCH_DTYPES = frozenset(_DTYPES)  # torch's dtypes, as the pickles of its objects name them (torch.float32)
_STORAGES = ("BFloat16 Bool Byte Char ComplexDouble ComplexFloat Double Float Half Int Long Short").split()
_QSTORAGES = ("QInt32 QInt8 QUInt2x4 QUInt4x2 QUInt8").split()
_TENSORS = ("BFloat16 Bool Byte Char Double Float Half Int Long Short").split()
_SPARSE = ("BFloat16 Byte Char Double Float Half Int Long Short").split()
TENSOR_REBUILDERS = frozenset({
    "_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
    "_rebuild_parameter_with_state", "_rebuild_qtensor", "_rebuild_sparse_tensor",
    "_rebuild_meta_tensor_no_storage", "_rebuild_nested_tensor", "_rebuild_wrapper_subclass",
    "_rebuild_device_tensor_from_numpy", "_rebuild_device_tensor_from_cpu_tensor",
})

TORCH_WEIGHTS_ONLY = frozenset({
    "collections.OrderedDict", "collections.Counter", "torch.nn.parameter.Parameter",
    "torch.serialization._get_layout", "torch.Size", "torch.Tensor", "torch.device", "_codecs.encode",
    "builtins.bytearray", "builtins.set", "builtins.complex", "torch._tensor._rebuild_from_type_v2",
    "torch.storage.TypedStorage", "torch.storage.UntypedStorage",
    "torch.per_tensor_affine", "torch.per_tensor_symmetric", "torch.per_channel_affine",
    "torch.per_channel_symmetric", "torch.per_channel_affine_float_qparams",
    *(f"torch.{d}" for d in _DTYPES),
    *(f"torch.{s}Storage" for s in _STORAGES + _QSTORAGES), *(f"torch.cuda.{s}Storage" for s in _STORAGES),
    *(f"torch.{t}Tensor" for t in _TENSORS), *(f"torch.cuda.{t}Tensor" for t in _TENSORS),
    *(f"torch.sparse.{t}Tensor" for t in _SPARSE), *(f"torch.cuda.sparse.{t}Tensor" for t in _SPARSE),
    *(f"torch._utils.{f}" for f in TENSOR_REBUILDERS),
})

# --- curated inert records of the formats ckpt-doctor reads, each with why unpickling it cannot run code ---------
# "Inert" means: what the pickle makes the loader do with it — look it up, call it with arguments the file chose,
# `cls.__new__(cls)` for NEWOBJ, `__setstate__`/`__dict__.update` for BUILD — only builds plain data. Any callable
# or class it receives comes from another global of the same file, which is judged on its own.

_DATACLASS = ("a dataclass of plain fields: NEWOBJ calls object.__new__ and BUILD fills __dict__, "
              "nothing else runs")
_ENUM = "an Enum: calling it with a value only looks the member up"
_BUILTIN_TYPE = "a builtin type: naming or calling it converts plain data and runs nothing else"

CURATED: dict[str, str] = {
    # torch.distributed.checkpoint's `.metadata` (torch 2.x) and its older sharded-tensor spelling.
    **{f"torch.distributed.checkpoint.metadata.{n}": _DATACLASS for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta")},
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING": _ENUM,
    "torch.distributed.checkpoint.filesystem._StorageInfo": _DATACLASS,
    "torch.distributed._shard.sharded_tensor.metadata.TensorProperties": _DATACLASS,
    "torch.distributed._shard.sharded_tensor.metadata.MEM_FORMAT_ENCODING": _ENUM,
    "torch.distributed._shard.metadata.ShardMetadata": _DATACLASS,
    # DCP's StorageMeta holds the checkpoint folder as a path.
    **{f"pathlib.{mod}{n}": "a path value: its constructor joins strings and touches no file" for n in (
        "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path") for mod in ("", "_local.")},
    # DeepSpeed checkpoints.
    "deepspeed.runtime.zero.config.ZeroStageEnum": _ENUM,
    "deepspeed.utils.tensor_fragment.fragment_address": _DATACLASS,
    "deepspeed.runtime.fp16.loss_scaler.LossScaler":
        "a record of scale settings: NEWOBJ calls object.__new__ and BUILD fills __dict__ (no __setstate__)",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler":
        "a record of scale settings: NEWOBJ calls object.__new__ and BUILD fills __dict__ (no __setstate__)",
    # NumPy values in optimizer states, callbacks and random states (numpy 1.x `numpy.core`, 2.x `numpy._core`).
    **{f"numpy.{core}.multiarray._reconstruct": "builds an empty ndarray of a type that is another global of the "
       "file; BUILD's ndarray.__setstate__ copies bytes with size checks, and an object array needs its items as "
       "a list the pickle built" for core in ("core", "_core")},
    **{f"numpy.{core}.multiarray.scalar": "copies a fixed-size buffer into a scalar of a given dtype; object "
       "dtypes are refused" for core in ("core", "_core")},
    "numpy.ndarray": "used as a type token by _reconstruct",
    "numpy.dtype": "parses a dtype description in C; given a class it makes an object dtype without calling it",
    # Not here: Hugging Face's TrainingArguments and accelerate's PartialState. Called through REDUCE (a file can
    # choose to), their __init__/__post_init__ run with the file's arguments: TrainingArguments opens an
    # fsdp_config path, PartialState sets process-wide state. transformers loads training_args.bin with
    # weights_only=False; ckpt-doctor reports it as code.
    "accelerate.utils.dataclasses.DistributedType": _ENUM,
    **{f"transformers.trainer_utils.{n}": _ENUM for n in (
        "IntervalStrategy", "SaveStrategy", "HubStrategy", "SchedulerType", "EvaluationStrategy")},
    "transformers.training_args.OptimizerNames": _ENUM,
    "transformers.debug_utils.DebugOption": _ENUM,
    # Training scripts' arguments, in many training checkpoints.
    "argparse.Namespace": "an attribute bag: NEWOBJ calls object.__new__ and BUILD fills __dict__",
    # Plain containers and values.
    "collections.defaultdict": ("a dict; its default factory is another global of the file, judged on its own, "
                                "and is not called while loading"),
    "copyreg._reconstructor": ("calls base.__new__(cls) and base.__init__ for cls and base that are other globals "
                               "of the file, judged on their own"),
    **{f"builtins.{n}": _BUILTIN_TYPE for n in (
        "frozenset", "slice", "range", "dict", "list", "tuple", "int", "float", "str", "bytes", "bool", "object")},
    "datetime.datetime": "a date-time value built from its packed bytes",
    "datetime.date": "a date value built from its packed bytes",
    "datetime.time": "a time value built from its packed bytes",
    "datetime.timedelta": "a duration built from three integers",
    "datetime.timezone": "a fixed-offset time zone built from a duration",
    # TorchScript's pickles tag lists with these; each returns its argument.
    **{f"torch.jit._pickle.{n}": "returns its argument unchanged" for n in (
        "build_intlist", "build_doublelist", "build_boollist", "build_tensorlist", "build_genericlist",
        "restore_type_tag")},
}

ALLOWED = TORCH_WEIGHTS_ONLY | frozenset(CURATED)

# --- what torch's own load path does with what a pickle hands it ------------------------------------------------
# An allowed name is not the end of it: torch.load(weights_only=False) unpickles with the full unpickler, and some
# of what it then does changes the process or touches files, whatever the globals. Each path, and what the walker
# (walker.py) and the unpickler (unpickler.py) do about it. docs/security.md names them.

SIDE_EFFECTS: dict[str, str] = {
    "BUILD on a global": (
        "BUILD on an object without __setstate__ updates its __dict__ and setattr()s its slot state: on a function, "
        "a class or a module (what every global but a torch dtype is) that changes it for the whole process. torch's "
        "own loaders read attributes set so (dump_patches and __name__, below). Dangerous, whatever the global; "
        "refused by the unpickler's stand-ins"),
    "BUILD on an enum member": (
        "calling an allowed Enum class (or NEWOBJ, OBJ, INST with it) returns its member, one object for the whole "
        "process; BUILD on it changes that member for every user. Dangerous"),
    "BUILD on what a call hands back": (
        "torch.jit._pickle's build_*list and restore_type_tag return their argument, a legacy or tar module record "
        "returns its container: BUILD on what they hand back is BUILD on a global when a global went in. "
        "Dangerous"),
    "_rebuild_from_type_v2 state": (
        "torch._tensor._rebuild_from_type_v2(func, type, args, state) calls func(*args) and, when the result is of "
        "exactly that type, setattr()s every item of state on it: with func anything but a torch._utils tensor "
        "rebuilder (an Enum class returns its member; an identity hands back a global) that is setattr on a "
        "process-wide object. Dangerous"),
    "legacy module record": (
        "the legacy format's persistent id (\"module\", container, source file, source): torch.load reads the "
        "container's source with inspect and, when it differs and container.dump_patches is true, appends a diff "
        "holding the file's source text to the file `container.__name__ + '.patch'` (an absolute path when __name__ "
        "is one). torch.save writes such records for nn.Module classes only (off the allow-list: code); one naming "
        "an allowed global, or what a call hands back, is dangerous"),
    "tar module record": (
        "the pre-0.4 tar format's persistent id (container, source file, source): the same source check and .patch "
        "write. Dangerous under the same terms"),
    "a computed persistent id": (
        "a persistent id that is the result of a call: the walk cannot tell whether the legacy loader takes it for "
        "a module record. Dangerous"),
    "storage records": (
        "(\"storage\", type, key, location, numel[, view]) records read bytes of the file itself and move them to "
        "the device the location names (which initializes that device): no file outside the checkpoint, no code "
        "named by the file"),
    "tar members": (
        "torch's tar loader extracts the members storages and tensors into a temporary folder and reads them back: "
        "a member that is a link reads what it points to (a hazard the tar reader reports), a sparse one reads "
        "what tarfile fills in"),
    "_codecs.encode": (
        "allowed by torch: the encoding name is looked up in the standard library's encodings package, which may "
        "import a module of that package; nothing outside it"),
}

# What calling (REDUCE, NEWOBJ, OBJ, INST) an allowed global returns, where that is not a new object.
HANDS_BACK = frozenset(f"torch.jit._pickle.{n}" for n in (
    "build_intlist", "build_doublelist", "build_boollist", "build_tensorlist", "build_genericlist",
    "restore_type_tag"))  # their first argument
# What calling these hashes: the items of their argument (of a dict, its keys; OrderedDict()'s pairs, their keys).
HASHING = frozenset({"collections.OrderedDict", "collections.Counter", "builtins.set", "builtins.frozenset"})
FROM_TYPE = "torch._tensor._rebuild_from_type_v2"  # func(*args), then state set on it by setattr
RECONSTRUCTOR = "copyreg._reconstructor"  # base.__new__(cls, state): a member when base is an Enum class
ENUMS = frozenset(q for q, why in CURATED.items() if why is _ENUM)  # calling one returns its member
# Globals that are values BUILD cannot change (no __dict__, no settable attribute): torch's dtypes and qschemes.
IMMUTABLE_VALUES = frozenset(
    {f"torch.{d}" for d in _DTYPES} | {f"torch.{q}" for q in (
        "per_tensor_affine", "per_tensor_symmetric", "per_channel_affine", "per_channel_symmetric",
        "per_channel_affine_float_qparams")})


def call_kind(module: str, name: str) -> str:
    """What calling the allowed global `module.name` returns: "argument" (its first argument, unchanged), "from type"
    (_rebuild_from_type_v2), "member" (an Enum's member), "reconstructor" (copyreg._reconstructor), "hashing" (a
    new container, made by hashing what it is given: HASHING) or "new"."""
    module, name = resolve(module, name)
    full = f"{module}.{name}"
    if full in HANDS_BACK:
        return "argument"
    if full == FROM_TYPE:
        return "from type"
    if full in ENUMS:
        return "member"
    if full == RECONSTRUCTOR:
        return "reconstructor"
    if full in HASHING:
        return "hashing"
    return "new"


def is_mutable(module: str, name: str) -> bool:
    """Whether BUILD or setattr can change the object `module.name` names (every global but torch's dtypes and
    qschemes: functions, classes and modules have attributes)."""
    module, name = resolve(module, name)
    return f"{module}.{name}" not in IMMUTABLE_VALUES

# --- what is known to run code ---------------------------------------------------------------------------------

# Modules every global of which can run commands, evaluate text, touch files or the network, or unpickle more.
DANGEROUS_MODULES = frozenset({
    "os", "posix", "nt", "posixpath", "ntpath", "subprocess", "_posixsubprocess", "_winapi", "sys", "importlib",
    "runpy", "pickle", "_pickle", "cPickle", "pickletools", "marshal", "shutil", "socket", "_socket", "ctypes",
    "pty", "code", "codeop", "commands", "webbrowser", "antigravity", "asyncio", "multiprocessing", "signal", "pdb",
    "bdb", "timeit", "types", "pkgutil", "pydoc", "operator", "_operator", "functools", "_functools", "io", "_io",
    "tempfile", "urllib", "urllib2", "requests", "http", "httplib", "ftplib", "smtplib", "telnetlib",
    "xmlrpc", "dill", "cloudpickle", "joblib", "shelve", "dbm", "platform", "ssl", "select", "selectors",
    "threading", "_thread", "gc", "inspect", "ast", "zipimport", "site", "sysconfig", "venv", "ensurepip",
    "distutils", "setuptools", "pip", "glob", "fileinput", "linecache", "tarfile", "zipfile", "trace",
    "cProfile", "profile", "imp", "yaml", "numpy.testing", "numpy.lib.npyio", "numpy.f2py", "numpy.distutils",
    "torch.hub", "torch.jit", "torch.utils.cpp_extension", "torch._dynamo", "torch._inductor", "torch.fx",
    "torch.package", "torch._C", "torch.ops", "torch._ops", "torch.multiprocessing", "torch.distributed.rpc",
    "torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launch", "torch.distributed.launcher",
    "torch.cuda.memory", "torch.utils.bottleneck", "torch.utils.benchmark", "keras", "tensorflow", "onnx",
    "sqlite3", "mmap", "resource", "getpass", "pwd", "crypt", "atexit", "faulthandler", "readline",
    "rlcompleter", "sched", "concurrent", "logging.config", "email", "mailbox", "smtpd", "aiohttp", "httpx",
    "pandas.io", "IPython", "jinja2", "builtins_exec", "uuid",
})

# Single names that load more pickles, files or code although their module is otherwise harmless.
DANGEROUS_NAMES = frozenset({
    "codecs.open", "codecs.getreader", "codecs.getwriter", "codecs.EncodedFile", "_codecs.lookup",
    "torch.load", "torch.serialization.load", "torch.serialization._load", "torch.serialization._legacy_load",
    "torch.storage._load_from_bytes", "torch.save", "torch.from_file", "torch.classes",
    "numpy.load", "numpy.loadtxt", "numpy.fromfile", "numpy.save", "numpy.frompyfunc", "numpy.vectorize",
    "numpy.core.multiarray._reconstruct_from_file", "collections._tuplegetter", "logging.Logger.manager",
    "torch._utils._rebuild_xla_tensor", "torch._utils._rebuild_mps_tensor", "pandas.read_pickle",
    "torch.utils.data.datapipes.utils.decoder", "numpy.ma.core._convert2ma",
})

# Builtins that are safe to name. Every other builtin (eval, exec, getattr, __import__, open, compile, ...) can
# run code or reach it.
SAFE_BUILTINS = frozenset({
    "set", "frozenset", "bytearray", "complex", "slice", "range", "dict", "list", "tuple", "int", "float", "str",
    "bytes", "bool", "object", "NoneType", "Ellipsis", "NotImplemented",
})

# Attribute names that, anywhere in a dotted name after its module, reach code: `mypkg.__builtins__` is a module's
# builtins, `x.modules` may be sys.modules (a dict whose `update` rewrites the process's modules).
_REACHING = frozenset({
    "eval", "exec", "system", "popen", "spawnv", "spawnl", "execv", "execl", "__import__", "getattr", "setattr",
    "delattr", "compile", "open", "__builtins__", "__globals__", "__subclasses__", "__code__", "__reduce__",
    "__reduce_ex__", "__getattribute__", "__loader__", "__spec__", "modules", "builtins", "load", "loads",
})
_BUILTIN_MODULES = ("builtins", "__builtin__", "__builtins__")
# The names modules commonly import others as (`import numpy as np`): `mypkg.np.save` is numpy.save.
_ALIASES = {"np": "numpy", "pd": "pandas", "pkl": "pickle", "mp": "multiprocessing", "tf": "tensorflow"}
# A package's own modules whose last part is also the name of a dangerous module: in `numpy.random._pickle.X` the
# `_pickle` is numpy's (numpy.random imports it by that name), not the standard library's. Runs that start after
# it are judged as any other.
_OWN_SUBMODULES = frozenset({"numpy.random._pickle"})


def resolve(module: str, name: str) -> tuple[str, str]:
    """The name Python 3 resolves a Python 2 spelling to (`__builtin__.eval` is builtins.eval), as CPython's
    unpickler does for protocols 0-2."""
    if (module, name) in NAME_MAPPING:
        return NAME_MAPPING[(module, name)]
    return IMPORT_MAPPING.get(module, module), name


def path_danger(parts: list[str]) -> str | None:
    """Why some reading of the dotted path `parts` is known to run code, or None. A path is judged by its worst
    reading, whatever the module/name split a pickle gives it: protocol 4 resolves a dotted name one attribute at a
    time, and an attribute of a module is whatever that module imported (`torch.serialization.os` is os, so
    `torch.serialization.os.system` is os.system; `torch.functional.torch.hub` is torch.hub). So every run of parts
    pk..pj, from any k, is read as a module path, and one that names a dangerous module or function (or a builtin
    that is not plain data) makes the whole path dangerous."""
    full = ".".join(parts)
    for k in range(len(parts)):
        if k and ".".join(parts[:k + 1]) in _OWN_SUBMODULES:
            continue  # a package's own module, not the standard library's one of that name (the next k is judged)
        run = _ALIASES.get(parts[k], parts[k]) if k else parts[k]
        via = f" (reached through {full})" if k else ""
        if run in _BUILTIN_MODULES:
            if k + 1 == len(parts):
                return f"reaches the builtins module through {full}"
            if parts[k + 1] not in SAFE_BUILTINS:
                return f"builtins.{parts[k + 1]} runs code or reaches it{via}"
        for j in range(k, len(parts)):
            if j > k:
                run += "." + parts[j]
            if run in DANGEROUS_MODULES:
                return f"{run} can run commands or code, touch files or the network{via}"
            if run in DANGEROUS_NAMES:
                return f"{run} loads another pickle, a file or code{via}"
    return None


def dangerous_reason(module: str, name: str) -> str | None:
    """Why the global `module.name` (as a pickle splits it) is known to run code, or None: the worst reading of its
    full path (path_danger), and any attribute step of `name` that reaches code (_REACHING; the module part is
    imported by its full name, so only the steps after it are attribute lookups)."""
    module, name = resolve(module, name)
    full = f"{module}.{name}"
    danger = path_danger(full.split("."))
    if danger is not None:
        return danger
    for part in name.split("."):
        if part in _REACHING:
            return f"reaches {part} through {full}"
    return None


@record
class Policy:
    """The allow-list as a value: torch's own `weights_only` list and the curated records of the formats read (always),
    plus the globals a user allows (`--allow-global`). Built once per command and passed to what reads, judges or
    writes; frozen, and hashable (a cache of verdicts is keyed by it)."""

    extra: frozenset[str] = frozenset()  # dotted names the user allows, each checked by check_user_allowance

    @staticmethod
    def allowing(names: Iterable[str] = ()) -> Policy:
        """The defaults and `names` (dotted, nothing known to run code: UsageError otherwise)."""
        return Policy(frozenset(check_user_allowance(n) for n in names))

    def classify(self, module: str, name: str) -> tuple[Verdict, str]:
        """The verdict on a global a pickle names, and the reason a person would want to read."""
        resolved_module, resolved_name = resolve(module, name)
        full = f"{resolved_module}.{resolved_name}"
        alias = "" if (resolved_module, resolved_name) == (module, name) else f" (the Python 2 name of {full})"
        if full in TORCH_WEIGHTS_ONLY:
            return Verdict.SAFE, "allowed by torch.load(weights_only=True)" + alias
        if full in CURATED:
            return Verdict.SAFE, CURATED[full] + alias
        danger = dangerous_reason(module, name)  # before the user's names: an allowed name, split otherwise, may
        if danger is not None:                    # reach code (`mypkg` + `modules.update` for mypkg.modules.update)
            return Verdict.DANGEROUS, danger + alias
        if full in self.extra:
            return Verdict.SAFE, "allowed with --allow-global" + alias
        if resolved_module.startswith("__torch__"):
            return Verdict.CODE, "a TorchScript class: loading the archive runs its TorchScript code"
        if not all(part.isidentifier() for part in full.split(".")):
            return Verdict.CODE, "not a Python name, yet torch.load(weights_only=False) would try to import it"
        if resolved_module.startswith("torch.nn.modules") or resolved_module.startswith("torch.nn."):
            return Verdict.CODE, "a module class: a whole pickled model, which needs its code to load"
        return Verdict.CODE, "not on the allow-list: torch.load(weights_only=False) would import and call it" + alias

    def writable(self, module: str, name: str) -> bool:
        """Whether an output may name the global `module` + `name`: torch.load(weights_only=True) accepts it, or the
        user allowed it and no reading of it reaches code (fix never writes anything else)."""
        module, name = resolve(module, name)
        full = f"{module}.{name}"
        return full in TORCH_WEIGHTS_ONLY or full in self.extra and dangerous_reason(module, name) is None


DEFAULT_POLICY = Policy()  # the defaults alone: torch's list and the curated records (immutable, as every Policy)


def classify(module: str, name: str, policy: Policy = DEFAULT_POLICY) -> tuple[Verdict, str]:
    """The verdict on a global a pickle names under `policy` (the defaults unless one is passed)."""
    return policy.classify(module, name)


def check_user_allowance(name: str) -> str:
    """A name the user wants to allow, checked: dotted `module.attr`, and no reading of it known to run code (torch
    refuses to allow os/sys/posix/nt the same way). The name says no module/name split, so it is refused when any
    reading of its parts is dangerous (path_danger: `torch.serialization.os.remove` is os.remove), when its last
    part reaches code, or when an attribute step that cannot be a module (a dunder such as __globals__) does. A
    part such as `modules` inside it is no reason (torch.nn.modules.linear.Linear): a pickle that splits the name to
    make it an attribute step is judged dangerous by Policy.classify before the allowance is looked at."""
    name = name.strip()
    parts = name.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise UsageError(f"--allow-global {name!r}: expected a dotted name such as mypkg.config.TrainConfig")
    module, name_ = resolve(".".join(parts[:-1]), parts[-1])
    danger = path_danger(f"{module}.{name_}".split("."))
    if danger is None and parts[-1] in _REACHING:
        danger = f"reaches {parts[-1]} through {name}"
    if danger is None:
        step = next((p for p in parts[1:] if p in _REACHING and p.startswith("__")), None)
        if step is not None:
            danger = f"reaches {step} through {name}"
    if danger is not None:
        raise UsageError(f"--allow-global {name}: refused, {danger}")
    return name
