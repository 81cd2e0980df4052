"""Headers the safetensors library refuses, which ckpt-doctor's reader (its one-pass reading of the compact spelling,
or its general reading) accepts, and one the reader cannot even name. The library is the authority on what a
safetensors file is: a file it refuses must be refused here with one clear `Error:` line, and what `fix` writes as
.safetensors must be a file the library loads."""

from __future__ import annotations

import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckpt_doctor.errors import ReadError
from ckpt_doctor.readers import read_checkpoint


def write(path, header: str, data: bytes = b"") -> str:
    raw = header.encode("utf-8")
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


def library_refuses(path: str) -> bool:
    try:
        with safe_open(path, framework="pt") as f:
            list(f.keys())
        return False
    except Exception:  # SafetensorError: refused
        return True


REFUSED_BY_THE_LIBRARY = {
    # spelled exactly as the reference writer spells a header: the one-pass reading takes it
    "complex128 (the library has C64, no C128)":
        ('{"a":{"dtype":"C128","shape":[4],"data_offsets":[0,64]}}', 64),
    # a metadata key twice (the last kept by JSON's reading) whose first value is not a string / a lone surrogate:
    # the library checks every value it reads
    "a metadata key twice, the first not a string":
        ('{"__metadata__":{"k":1,"k":"v"},"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}', 16),
    "a metadata key twice, the first a lone surrogate":
        ('{"__metadata__":{"k":"\\ud800","k":"v"},"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}', 16),
    # the general reading: dims whose product overflows 64 bits before a 0 dim (the library multiplies left to
    # right with checked_mul), one past 2**64, __metadata__ twice, a key twice whose first entry is not valid
    "dims overflowing before a 0 dim":
        ('{"a":{"dtype":"U8","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}}', 0),
    "a dim past 2**64": ('{"a":{"dtype":"U8","shape":[18446744073709551616,0],"data_offsets":[0,0]}}', 0),
    "__metadata__ twice":
        ('{"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},'
         '"__metadata__":{"k":"w"}}', 16),
    "a key twice, the first not valid":
        ('{"a":{"dtype":"NOPE","shape":[4],"data_offsets":[0,16]},'
         '"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}', 16),
    "a key twice, the first with a lone surrogate":
        ('{"a":{"dtype":"F32\\ud800","shape":[4],"data_offsets":[0,16]},'
         '"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}', 16),
    # __metadata__ that is not an object but falsy (`header.pop(...) or {}` takes it for none)
    **{f"__metadata__ {value}": ('{"__metadata__":%s,"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}' % value,
                                 16) for value in ('""', "[]", "0", "false")},
    # values JSON does not have, in a field the library ignores (Python's json reads them as floats)
    **{f"an ignored field {value}": ('{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16],"x":%s}}' % value, 16)
       for value in ("NaN", "Infinity", "1e400")},
}


@pytest.mark.parametrize("name", list(REFUSED_BY_THE_LIBRARY))
def test_a_header_the_library_refuses_is_refused(name, tmp_path):
    header, nbytes = REFUSED_BY_THE_LIBRARY[name]
    path = write(tmp_path / "case.safetensors", header, b"\0" * nbytes)
    assert library_refuses(path)
    with pytest.raises(ReadError):
        read_checkpoint(path)


def test_dims_of_thousands_of_digits_end_in_one_error_line(tmp_path, cli):
    """Two dims of 2,200 digits: their product has more digits than Python prints, and the message that names it
    failed with `Error: internal error (ValueError ...)`. The library refuses the file (a dim past usize)."""
    dim = "9" * 2200
    path = write(tmp_path / "huge.safetensors",
                 '{"a":{"dtype":"F32","shape":[%s,%s],"data_offsets":[0,16]}}' % (dim, dim), b"\0" * 16)
    assert library_refuses(path)
    result = cli("inspect", path, "--json")
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: ") and "internal error" not in result.stderr, result.stderr
    assert result.stdout == ""


def test_fix_writes_complex128_only_where_the_library_loads_it(tmp_path, cli):
    """safetensors has no complex128 code: `fix` must refuse to write one (exit 2, as for any dtype without a code),
    never write a file with `C128` that the library cannot load and report it verified."""
    source, out = tmp_path / "c.pt", tmp_path / "c.safetensors"
    torch.save({"w": torch.randn(3, dtype=torch.complex128), "b": torch.ones(2)}, source)
    result = cli("fix", source, "-o", out)
    if result.exit_code == 0:
        loaded = load_file(str(out))  # raises SafetensorError (unknown variant `C128`) on the current code
        assert loaded["w"].dtype == torch.complex128
    else:
        assert result.exit_code == 2 and result.stderr.startswith("Error: ")
        assert not out.exists()
