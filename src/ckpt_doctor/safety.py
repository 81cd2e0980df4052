"""Which globals a pickle may name: the allow-list, the known-dangerous list, and the verdict for anything else."""

from __future__ import annotations

from .dtypes import ELEMENT_SIZE, STORAGE_CLASS_DTYPE
from .records import Verdict, ancestors

# Globals that rebuild tensors, storages and plain containers. The unpickler maps each to an inert
# stand-in of its own; the real object is never imported.
TENSOR_REBUILDERS = frozenset({
    "_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
    "_rebuild_parameter_with_state", "_rebuild_qtensor", "_rebuild_sparse_tensor",
    "_rebuild_meta_tensor_no_storage", "_rebuild_nested_tensor", "_rebuild_wrapper_subclass",
    "_rebuild_device_tensor_from_numpy", "_rebuild_device_tensor_from_cpu_tensor",
})

SAFE_GLOBALS = frozenset({
    "collections.OrderedDict", "collections.Counter", "collections.defaultdict",
    "torch.nn.parameter.Parameter", "torch.serialization._get_layout", "torch.Size", "torch.Tensor",
    "torch.device", "torch._tensor._rebuild_from_type_v2", "torch.storage.UntypedStorage",
    "torch.storage.TypedStorage", "torch.per_tensor_affine", "torch.per_tensor_symmetric",
    "torch.per_channel_affine", "torch.per_channel_symmetric", "torch.per_channel_affine_float_qparams",
    "torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch._utils._rebuild_device_tensor_from_numpy",
    "_codecs.encode", "copyreg._reconstructor",
    "torch.jit._pickle.build_intlist", "torch.jit._pickle.build_doublelist", "torch.jit._pickle.build_boollist",
    "torch.jit._pickle.build_tensorlist", "torch.jit._pickle.build_genericlist", "torch.jit._pickle.restore_type_tag",
    "builtins.set", "builtins.frozenset", "builtins.bytearray", "builtins.complex", "builtins.slice",
    "builtins.range", "builtins.dict", "builtins.list", "builtins.tuple", "builtins.int", "builtins.float",
    "builtins.str", "builtins.bytes", "builtins.bool", "builtins.object",
    "__builtin__.set", "__builtin__.frozenset", "__builtin__.object",
}) | {f"torch._utils.{f}" for f in TENSOR_REBUILDERS} \
   | {f"torch.{cls}" for cls in STORAGE_CLASS_DTYPE} | {f"torch.cuda.{cls}" for cls in STORAGE_CLASS_DTYPE} \
   | {f"torch.{dtype}" for dtype in ELEMENT_SIZE}

# Modules whose every global can run code, read or write files, or reach the network.
DANGEROUS_MODULES = frozenset({
    "os", "posix", "nt", "posixpath", "ntpath", "subprocess", "_posixsubprocess", "_winapi", "sys", "importlib",
    "runpy", "pickle", "_pickle", "cPickle", "pickletools", "marshal", "shutil", "socket", "_socket", "ctypes",
    "pty", "code", "codeop", "commands", "webbrowser", "asyncio", "multiprocessing", "signal", "pdb", "bdb",
    "timeit", "types", "pkgutil", "pydoc", "operator", "_operator", "functools", "_functools", "io", "_io",
    "pathlib", "tempfile", "urllib", "urllib2", "requests", "http", "httplib", "ftplib", "smtplib", "telnetlib",
    "xmlrpc", "dill", "cloudpickle", "joblib", "shelve", "dbm", "platform", "ssl", "select", "selectors",
    "threading", "_thread", "gc", "inspect", "ast", "builtins_exec", "zipimport", "site", "sysconfig",
    "venv", "ensurepip", "distutils", "setuptools", "pip", "glob", "fileinput", "linecache", "tarfile",
    "zipfile", "code", "trace", "cProfile", "profile", "imp", "uuid", "yaml", "numpy.testing", "torch.hub",
    "torch.jit", "torch.utils.cpp_extension", "torch._dynamo", "torch._inductor", "torch.fx", "torch.package",
    "torch._C", "torch.ops", "torch._ops", "torch.multiprocessing", "torch.distributed",
    "torch.cuda.memory", "numpy.lib.npyio", "numpy.f2py", "numpy.distutils", "keras", "tensorflow", "onnx",
    "sqlite3", "mmap", "resource", "getpass", "pwd", "crypt", "atexit", "faulthandler", "readline",
    "rlcompleter", "sched", "concurrent", "logging.config", "email", "mailbox", "smtpd", "aiohttp", "httpx",
})

# Single names that load more pickles, run code or open files although their module is otherwise harmless.
DANGEROUS_NAMES = frozenset({
    "codecs.open", "codecs.getreader", "codecs.getwriter", "codecs.EncodedFile", "_codecs.lookup",
    "torch.load", "torch.serialization.load", "torch.serialization._load", "torch.serialization._legacy_load",
    "torch.storage._load_from_bytes", "torch.save", "torch.from_file", "torch.classes",
    "numpy.load", "numpy.loadtxt", "numpy.fromfile", "numpy.save", "numpy.frompyfunc", "numpy.vectorize",
    "numpy.core.multiarray._reconstruct_from_file", "collections._tuplegetter", "logging.Logger.manager",
    "torch._utils._rebuild_xla_tensor", "torch._utils._rebuild_mps_tensor",
})

SAFE_BUILTINS = frozenset({
    "set", "frozenset", "bytearray", "complex", "slice", "range", "dict", "list", "tuple", "int", "float", "str",
    "bytes", "bool", "object", "NoneType", "Ellipsis", "NotImplemented",
})


def classify_global(module: str, name: str) -> tuple[Verdict, str]:
    """Verdict for a global named by a pickle, with the reason a person would want to read."""
    qualname = f"{module}.{name}"
    if qualname in SAFE_GLOBALS:
        return Verdict.SAFE, "allow-listed"
    if module in ("builtins", "__builtin__", "__builtins__"):
        if name in SAFE_BUILTINS:
            return Verdict.SAFE, "allow-listed"
        return Verdict.DANGEROUS, f"builtins.{name} can run code or reach attributes"
    if qualname in DANGEROUS_NAMES:
        return Verdict.DANGEROUS, "loads another pickle, a file or code"
    if any(m in DANGEROUS_MODULES for m in ancestors(module)):
        return Verdict.DANGEROUS, f"module {module} can run code, touch files or the network"
    if module.startswith("__torch__"):
        return Verdict.UNKNOWN, "TorchScript class (its code is not run)"
    if module.startswith("torch.nn.") or module.startswith("torch.optim"):
        return Verdict.UNKNOWN, "torch class (not imported)"
    return Verdict.UNKNOWN, "class or function named by the file (not imported)"
