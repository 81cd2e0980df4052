"""Dtype names and sizes, without importing torch: torch's names, storage classes and safetensors codes; and a
tensor's elements as bytes, and a cast that refuses to make values inf (torch imported then)."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    import torch

# dtype name (as torch prints it, without `torch.`) -> element size in bytes
ELEMENT_SIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
    "qint8": 1, "quint8": 1, "qint32": 4, "quint4x2": 1, "quint2x4": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
}
for _n in range(1, 8):
    ELEMENT_SIZE.setdefault(f"int{_n}", 1)
    ELEMENT_SIZE.setdefault(f"uint{_n}", 1)

# Legacy typed storage class (torch.FloatStorage, ...) -> dtype name
STORAGE_CLASS_DTYPE: dict[str, str] = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128", "ComplexFloatStorage": "complex64",
    "QInt8Storage": "qint8", "QUInt8Storage": "quint8", "QInt32Storage": "qint32",
    "QUInt4x2Storage": "quint4x2", "QUInt2x4Storage": "quint2x4",
    "UntypedStorage": "uint8",
}

# Aliases torch accepts as attributes of the torch module.
DTYPE_ALIASES: dict[str, str] = {
    "float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32",
    "short": "int16", "cfloat": "complex64", "cdouble": "complex128", "chalf": "complex32",
}
# Short names people write on a command line (mixed-precision flags and Hugging Face configs): for user input only,
# never for a name a pickle gives (torch has no `torch.fp16`).
SHORT_NAMES: dict[str, str] = {
    "fp16": "float16", "f16": "float16", "bf16": "bfloat16", "fp32": "float32", "f32": "float32",
    "fp64": "float64", "f64": "float64",
}

# Quantized dtypes: their values need the scale and zero point _rebuild_qtensor carries, which no record keeps.
QUANTIZED = frozenset({"qint8", "quint8", "qint32", "quint4x2", "quint2x4"})

FLOATING = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
                      "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"})

# safetensors dtype code <-> torch dtype name
SAFETENSORS_TO_TORCH: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "C64": "complex64",  # no complex128: the library has no code for it
}
TORCH_TO_SAFETENSORS: dict[str, str] = {v: k for k, v in SAFETENSORS_TO_TORCH.items()}


def torch_dtype_name(name: str) -> str | None:
    """`float`/`float32`/`torch.float32` -> `float32`; None when it is not a dtype torch has."""
    name = name.removeprefix("torch.")
    name = DTYPE_ALIASES.get(name, name)
    return name if name in ELEMENT_SIZE else None


def user_dtype_name(text: str) -> str | None:
    """A dtype as a person writes it on a command line: torch's names and aliases (`half`, `torch.float16`), any
    case, and the short ones (`fp16`, `bf16`)."""
    name = text.strip().lower()
    return torch_dtype_name(SHORT_NAMES.get(name, name))


def element_size(dtype: str) -> int:
    return ELEMENT_SIZE[dtype]


def tensor_bytes(tensor: "torch.Tensor") -> bytes:
    """A tensor's elements in row-major order as bytes, without numpy (not a dependency)."""
    import torch  # torch: ~1 s, only when a tensor's bytes are asked for

    buf = bytearray(tensor.numel() * tensor.element_size())
    if buf:
        torch.frombuffer(buf, dtype=tensor.dtype).copy_(tensor.reshape(-1))
    return bytes(buf)


class Cast:
    """One storage converted to another dtype, a block at a time, counting the finite values the cast makes
    infinite (float16 holds |x| up to 65504): `done` refuses the write when it made any, as an inf written for a
    weight is data lost that nothing else would notice. Looking costs one aminmax of each block converted."""

    def __init__(self, src: str, dst: str, key: str) -> None:
        self.src, self.dst, self.key = src, dst, key  # key: the output's name of the storage's (first) tensor
        self.lost = 0
        self.largest = 0.0  # the largest |x| of the values lost

    def block(self, data: bytes | bytearray) -> bytes:
        """The bytes of `data` (elements of `src`) as `dst`."""
        import torch  # torch: ~1 s, only when a dtype is converted

        return tensor_bytes(self.tensor(torch.frombuffer(bytearray(data), dtype=getattr(torch, self.src))))

    def tensor(self, tensor: "torch.Tensor") -> "torch.Tensor":
        import torch  # torch: ~1 s, only when a dtype is converted

        dst = getattr(torch, self.dst)
        out = tensor.to(dst)
        if not out.numel() or torch.finfo(dst).max >= torch.finfo(tensor.dtype).max:
            return out  # a dtype of a range as wide holds every value
        # aminmax of the output: a pass cheaper than the conversion (isfinite of float16 costs several times it); an
        # inf or nan there (rare: the source's own, or the cast's) is then counted exactly
        low, high = torch.aminmax(out)
        if not (bool(low.isfinite()) and bool(high.isfinite())):
            lost = torch.isfinite(tensor) & ~torch.isfinite(out)
            count = int(lost.sum())
            if count:
                self.lost += count
                self.largest = max(self.largest, float(tensor[lost].abs().max()))
        return out

    def done(self) -> None:
        """Refuses the write (WriteError) when the cast made finite values infinite, with the dtype that holds them."""
        if not self.lost:
            return
        import torch  # (imported by the cast already)

        from .errors import Rerun, WriteError

        top = torch.finfo(getattr(torch, self.dst)).max
        wider = [d for d in ("bfloat16", "float32") if torch.finfo(getattr(torch, d)).max > max(top, self.largest)]
        them = "it" if self.lost == 1 else "them"
        way = "bfloat16 keeps float32's range: {0}" if wider[:1] == ["bfloat16"] else \
            f"{wider[0]} holds {them}: {{0}}" if wider else f"only {self.src} holds {them}; without --dtype: {{0}}"
        values = "1 finite value" if self.lost == 1 else f"{self.lost:,} finite values"
        raise WriteError(f"{self.key}: {values} beyond {self.dst}'s range (largest |x| {self.largest:.6g}; {self.dst} "
                         f"holds up to {top:.6g}) would be written as inf; nothing written; {way}",
                         reruns=(Rerun(add=("--dtype", wider[0]) if wider else (), remove=("--dtype", self.dst)),))


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape`, in elements (a dimension of size 0 counts as 1, as torch's)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
