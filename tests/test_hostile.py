"""Files built to make a scanner and torch.load see different bytes (found by attacking ckpt-doctor itself).

Each payload here is live: torch.load (or np.load) in a subprocess creates the canary. ckpt-doctor must give
exit 1 from both scan and inspect, and run nothing.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import subprocess
import sys
import tarfile
import zipfile
import zlib

import pytest
import torch

from ckpt_doctor.safepickle import limits
from ckpt_doctor.safepickle.walker import walk
from tests.helpers import child_fires
from tests.payloads import _str, global_op, object_npy, tar_members, torch_zip
from tests.test_safety import legacy_file


def payload(canary) -> bytes:
    """Opcodes that leave one value on the stack and touch the canary when run: posix.system(...)."""
    return b"cposix\nsystem\n(S'touch " + str(canary).encode() + b"'\ntR"


def live(path, canary, how: str = "path") -> bool:
    """Whether loading the file for real runs the payload (the canary appears), in a child process."""
    loaders = {
        "path": "torch.load(p, weights_only=False)",
        "bytesio": "torch.load(io.BytesIO(open(p, 'rb').read()), weights_only=False)",
        "np": "dict(numpy.load(p, allow_pickle=True)) if p.endswith(('.npz', '.pt')) else numpy.load(p, "
              "allow_pickle=True)",
    }
    code = (f"import io, sys, torch, numpy\np = sys.argv[1]\ntry:\n    x = {loaders[how]}\n"
            "    [x[k] for k in x] if isinstance(x, dict) else None\nexcept Exception:\n    pass\n")
    return child_fires(code, path, canary)


def flagged(cli, path) -> tuple[int, int]:
    return cli("scan", path).exit_code, cli("inspect", path).exit_code


def straddling_frame(value: bytes, hidden: bytes) -> bytes:
    """A protocol-4 pickle whose FRAME ends one byte into a BINUNICODE length. CPython, reading through read()
    (a BytesIO, an unbuffered file), drops that byte and takes the length from after the frame: it pushes a
    1-byte string, pops it, runs `hidden` and stops. Read contiguously the string is 256 bytes longer and swallows
    `hidden`. `value` (opcodes) is what both readings return."""
    frame = value + b"X\x00"
    c_path = b"\x01\x00\x00\x00z0" + hidden + b"."  # CPython: length 1 read after the frame, POP, payload, STOP
    contiguous_len = 0x100  # read on: the frame's 00, then 01 00 00 — 256
    after = c_path + b"\0" * (3 + contiguous_len - len(c_path)) + b"0."
    assert len(c_path) <= 3 + contiguous_len
    return b"\x80\x04\x95" + struct.pack("<Q", len(frame)) + frame + after


def test_a_frame_that_ends_inside_an_opcode_is_flagged(tmp_path, cli):
    canary = tmp_path / "CANARY"
    sd = b"}(" + _str("w") + b"N" + b"u"
    path = tmp_path / "straddle.pt"
    path.write_bytes(torch_zip(straddling_frame(sd, payload(canary) + b"0"), {}))
    assert live(path, canary, "bytesio")  # torch.load of the same bytes from a stream runs it
    assert flagged(cli, path) == (1, 1)
    assert "frame" in cli("scan", path).stderr


def test_a_tar_member_read_without_peek_is_flagged(tmp_path, cli):
    """torch reads a tar member through an unbuffered file: a straddling frame in `storages` hides a pickle."""
    canary = tmp_path / "CANARY"
    members = tar_members({"w": [1.0]})
    count = b"\x80\x02K\x01."
    storage_args = straddling_frame(b"J\x01\x00\x00\x00" + _str("cpu") + global_op("torch", "FloatStorage") + b"\x87",
                                    payload(canary) + b"0")
    members["storages"] = count + storage_args + struct.pack("<qf", 1, 1.0) + b"\x80\x02]."
    path = tmp_path / "straddle.tar"
    _write_tar(path, members)
    assert live(path, canary)
    assert flagged(cli, path) == (1, 1)


def _write_tar(path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _octal(n: int, width: int) -> bytes:
    return (b"%0*o" % (width - 1, n)) + b"\0"


def _header(name: bytes, typeflag: bytes, size: int, checksum_prefix: bytes = b"", extra=None) -> bytes:
    h = bytearray(512)
    h[:len(name)] = name
    h[100:108], h[108:116], h[116:124] = _octal(0o644, 8), _octal(0, 8), _octal(0, 8)
    h[124:136], h[136:148], h[156:157] = _octal(size, 12), _octal(0, 12), typeflag
    h[257:265] = b"ustar  \0"
    for at, data in (extra or {}).items():
        h[at:at + len(data)] = data
    h[148:156] = b" " * 8
    h[148:156] = (checksum_prefix + b"%06o\0 " % sum(h))[:8]
    return bytes(h)


def _block(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 512)


def test_a_sparse_tar_member_is_flagged(tmp_path, cli):
    """tarfile fills a sparse member's holes when torch extracts it: the bytes on disk are not what runs."""
    canary = tmp_path / "CANARY"
    rest = b"0" + payload(canary) + b"0K\x00." + b"\x80\x02]."  # after the hole: POP the zeros, run, count 0, views
    stored = len(_block(b"X" * (5 + len(rest))))
    hole = stored + 512 - 5
    first = b"B" + struct.pack("<I", hole)  # BINBYTES of the hole: zeros for torch, the next bytes on disk for a scan
    real = 5 + hole + len(rest)
    sparse = {386: _octal(0, 12) + _octal(5, 12) + _octal(5 + hole, 12) + _octal(len(rest), 12), 482: b"\0",
              483: _octal(real, 12)}
    out = _header(b"storages", b"S", 5 + len(rest), extra=sparse) + _block(first + rest)
    for name, data in (("tensors", b"\x80\x02K\x00."), ("pickle", b"\x80\x02}.")):
        out += _header(name.encode(), b"0", len(data)) + _block(data)
    path = tmp_path / "sparse.tar"
    path.write_bytes(out + b"\0" * 1024)
    assert live(path, canary)
    assert flagged(cli, path) == (1, 1)
    assert "sparse" in cli("scan", path).stderr


def test_a_tar_checksum_field_is_parsed_as_tarfile_parses_it(tmp_path, cli):
    """str.strip() strips \\x1c, bytes.strip() does not: tarfile accepts this header, so torch takes the tar."""
    canary = tmp_path / "CANARY"
    storages = payload(canary) + b"0K\x00." + b"\x80\x02]."
    out = _header(b"\x80\x02}.", b"0", 0, checksum_prefix=b"\x1c")  # its name is a harmless pickle
    for name, data in (("storages", storages), ("tensors", b"\x80\x02K\x00."), ("pickle", b"\x80\x02}.")):
        out += _header(name.encode(), b"0", len(data)) + _block(data)
    path = tmp_path / "checksum.tar"
    path.write_bytes(out + b"\0" * 1024)
    assert live(path, canary)
    assert flagged(cli, path) == (1, 1)


def test_a_tar_that_is_also_a_long_pickle_is_flagged(tmp_path, cli):
    """From byte 0 the file is a pickle whose STOP comes after a megabyte: walked whole, not its first MB."""
    canary = tmp_path / "CANARY"
    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name, data in tar_members({"w": [1.0]}).items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    body = tar.getvalue()
    # A leading member whose name starts a BINBYTES8 that swallows 1.5 MB, then the payload, then STOP.
    filler = b"\0" * (3 << 19)
    lead_data = filler + payload(canary) + b"."
    name = b"\x8e" + struct.pack("<Q", 512 - 9 + len(filler))
    path = tmp_path / "long.tar"
    path.write_bytes(_header(name[:100].ljust(9, b"\0"), b"0", len(lead_data)) + _block(lead_data) + body)
    with tarfile.open(path) as t:
        assert "storages" in t.getnames()
    assert flagged(cli, path) == (1, 1)


def test_an_object_array_inside_a_checkpoint_or_an_npz_is_walked(tmp_path, cli):
    import numpy as np

    canary = tmp_path / "CANARY"
    buf = io.BytesIO()
    np.save(buf, np.array([None], dtype=object), allow_pickle=True)
    raw = buf.getvalue()
    start = raw.index(b"\x80")
    evil_npy = raw[:start] + b"\x80\x03" + payload(canary) + b"."
    base = tmp_path / "base.pt"
    torch.save({"w": torch.zeros(1)}, base)
    with zipfile.ZipFile(base) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    prefix = next(iter(members)).split("/")[0]
    members[f"{prefix}/evil.npy"] = evil_npy
    for name, data in {"hidden.pt": members, "plain.npz": {"x.npy": evil_npy}}.items():
        path = tmp_path / name
        with zipfile.ZipFile(path, "w") as z:
            for member, content in data.items():
                z.writestr(member, content)
        assert live(path, canary, "np"), name
        assert flagged(cli, path) == (1, 1), name
    # `descr: 'object'` and a header whose `shape` comes first are object arrays too
    header = b"{'shape': (1,), 'fortran_order': False, 'descr': 'object', }"
    header += b" " * (-(10 + len(header) + 1) % 64) + b"\n"
    path = tmp_path / "descr.npy"
    path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + b"\x80\x03" + payload(canary)
                     + b".")
    assert live(path, canary, "np")
    assert flagged(cli, path) == (1, 1)


def test_an_object_npy_whose_header_is_also_a_tar_header_is_flagged(tmp_path, cli):
    """An .npy of object dtype whose first 512 bytes also pass as a tar header (a field name of blanks holds the tar
    checksum): np.load runs its pickle, whether or not tarfile opens the block, so the .npy's pickle is walked."""
    canary = tmp_path / "CANARY"
    for variant in ("tarfile opens it", "tarfile refuses it"):
        text = "{'descr': [('" + " " * 400 + "', '|O')], 'fortran_order': False, 'shape': (1,), }"
        text = text.ljust(556) + "\n"
        head = bytearray(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode())
        if variant == "tarfile refuses it":
            head[100:108] = b"  xyz   "  # the tar mode field, inside the blank name: no octal number
        head[148:156] = b" " * 8
        checksum = sum(head[:148]) + 256 + sum(head[156:512])
        head[148:156] = b"%06o  " % checksum
        path = tmp_path / "polyglot.npy"
        path.write_bytes(bytes(head) + b"\x80\x02" + payload(canary) + b".")
        assert tarfile.is_tarfile(path) == (variant == "tarfile opens it")
        assert live(path, canary, "np"), variant
        assert flagged(cli, path) == (1, 1), variant
        assert "posix.system" in cli("scan", path).stdout, variant


def test_a_refused_pickle_still_names_its_payload(tmp_path, cli):
    """A memo bomb or a huge integer before the payload: the file is refused, and the payload named (exit 1)."""
    canary = tmp_path / "CANARY"
    for name, trap in {"memo": b"Nr\x40\x42\x0f\x000", "long": b"\x8b" + struct.pack("<i", 1025) + b"\x01" * 1025
                       + b"0"}.items():
        path = tmp_path / f"{name}.pt"
        path.write_bytes(torch_zip(b"\x80\x02" + trap + b"}(" + _str("x") + payload(canary) + b"u.", {}))
        assert live(path, canary), name
        scan, inspect = cli("scan", path), cli("inspect", path)
        assert scan.exit_code == inspect.exit_code == 1, name
        assert "posix.system" in inspect.stderr and "refused" in inspect.stderr


def test_a_member_that_inflates_past_its_size_is_read_as_miniz_reads_it(tmp_path, cli):
    """miniz fills a buffer of the directory's size and stops: the first `size` bytes are what torch unpickles."""
    canary = tmp_path / "CANARY"
    data_pkl = b"\x80\x02" + payload(canary) + b"0}."
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    deflated = comp.compress(data_pkl + b"extra bytes past the declared size") + comp.flush()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/version", "3\n")
    members = [("archive/data.pkl", deflated, len(data_pkl), 8), ("archive/version", b"3\n", 2, 0)]
    path = tmp_path / "overlong.pt"
    path.write_bytes(_zip_raw(members))
    assert live(path, canary)
    assert flagged(cli, path) == (1, 1)


def _zip_raw(members) -> bytes:
    out, central = bytearray(), bytearray()
    for name, data, size, method in members:
        raw = name.encode()
        crc = zlib.crc32(data) if method == 0 else 0
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, method, 0, 0, crc, len(data), size,
                               len(raw), 0, 0, 0, 0, 0, len(out)) + raw
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0, crc, len(data), size, len(raw), 0) + raw
        out += data
    at = len(out)
    out += central + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(central), at, 0)
    return bytes(out)


def test_a_pickle_bigger_than_ckpt_doctor_unpickles_is_still_walked(tmp_path, cli):
    canary = tmp_path / "CANARY"
    path = tmp_path / "big.pkl"
    with open(path, "wb") as f:
        f.write(b"\x80\x02" + payload(canary) + b"0\x8e" + struct.pack("<Q", 300 << 20))
        f.truncate(f.tell() + (300 << 20))  # sparse: 300 MB of zeros that cost no disk
        f.seek(0, 2)
        f.write(b"0N.")
    assert flagged(cli, path) == (1, 1)


@pytest.mark.parametrize("entry", ["seed", "device"])
def test_values_that_once_ended_in_internal_errors(tmp_path, cli, entry):
    path = tmp_path / f"{entry}.pt"
    if entry == "seed":
        torch.save({"w": torch.zeros(1), "seed": 2 ** 2400}, path)
        out = tmp_path / "out.pt"
        refused = cli("fix", path, "-o", out)  # torch.load(weights_only=True) cannot read such an int (LONG4)
        assert refused.exit_code == 2 and "seed" in refused.stderr and "internal error" not in refused.stderr
        assert not out.exists()
        assert cli("fix", path, "-o", out, "--drop", "^seed$").exit_code == 0
        assert set(torch.load(out)) == {"w"}
    else:
        from fixtures.make_fixtures import saved_on

        with saved_on("cuda:\u00b2"):
            torch.save({"w": torch.zeros(1)}, path)
        result = cli("inspect", path)
        assert result.exit_code == 0 and "internal error" not in result.stderr


def test_inspect_of_a_folder_judges_its_other_files_as_scan_does(tmp_path, cli):
    canary = tmp_path / "CANARY"
    folder = tmp_path / "run"
    folder.mkdir()
    torch.save({"w": torch.zeros(1)}, folder / "pytorch_model.bin")
    (folder / "optimizer.pt").write_bytes(torch_zip(straddling_frame(b"}", payload(canary) + b"0"), {}))
    assert cli("scan", folder).exit_code == cli("inspect", folder).exit_code == 1
    assert not canary.exists()
    os.remove(folder / "optimizer.pt")
    assert cli("scan", folder).exit_code == cli("inspect", folder).exit_code == 0


# --- Found by the second attack on the safety core ---------------------------------------------------------------

def _torch_zip_members(tmp_path) -> dict[str, bytes]:
    base = tmp_path / "base.pt"
    torch.save({"w": torch.zeros(2)}, base)
    with zipfile.ZipFile(base) as z:
        return {i.filename: z.read(i) for i in z.infolist()}


def _stored_zip(members: dict[str, bytes]) -> bytes:
    return _zip_raw([(name, data, len(data), 0) for name, data in members.items()])


@pytest.mark.parametrize("name", ["archive/data/evil.npy", "archive/.storage_alignment", "archive/byteorder"])
def test_an_object_array_is_found_by_its_magic_whatever_its_name(tmp_path, cli, name):
    """np.load reads any member that starts with the .npy magic: names of storages and records hide nothing."""
    canary = tmp_path / "CANARY"
    members = _torch_zip_members(tmp_path)
    prefix = next(iter(members)).split("/")[0]
    members[name.replace("archive", prefix)] = object_npy(b"\x80\x02" + payload(canary) + b".")
    path = tmp_path / "hidden.pt"
    path.write_bytes(_stored_zip(members))
    assert live(path, canary, "np")
    assert flagged(cli, path) == (1, 1)


@pytest.mark.parametrize("big", [False, True], ids=["read-whole", "read-in-blocks"])
def test_an_object_array_among_many_storages_is_found(tmp_path, cli, big):
    """One storage of hundreds (named data/N, as torch names them all) is an object array np.load would unpickle:
    it is found in an archive small enough to be read whole, and in one over 16 MB, whose local headers are read
    in blocks."""
    canary = tmp_path / "CANARY"
    state = {f"layers.{i}.weight": torch.zeros(256) for i in range(300)}
    if big:
        state = {"embed.weight": torch.zeros(17 << 18), **state}  # 17 MB first, the small storages after it
    torch.save(state, tmp_path / "base.pt")
    with zipfile.ZipFile(tmp_path / "base.pt") as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    prefix = next(iter(members)).split("/")[0]
    name = f"{prefix}/data/{len(state) - 150}"
    npy = object_npy(b"\x80\x02" + payload(canary) + b".")
    members[name] = npy + b"\0" * (len(members[name]) - len(npy))  # as many bytes as the tensor needs
    path = tmp_path / "many.pt"
    path.write_bytes(_stored_zip(members))
    assert (path.stat().st_size > 16 << 20) == big
    assert live(path, canary, "np")
    assert flagged(cli, path) == (1, 1)


def test_a_member_only_pythons_zipfile_sees_is_walked(tmp_path, cli):
    """The end record counts one member fewer than its directory holds: torch's reader stops at the count,
    Python's zipfile (np.load) reads the directory to its end and finds the object array."""
    canary = tmp_path / "CANARY"
    members = _torch_zip_members(tmp_path)
    members["archive/evil.npy"] = object_npy(b"\x80\x02" + payload(canary) + b".")
    data = bytearray(_stored_zip(members))
    count = len(members) - 1
    struct.pack_into("<HH", data, len(data) - 22 + 8, count, count)
    path = tmp_path / "counted.pt"
    path.write_bytes(bytes(data))
    assert "archive/evil.npy" in zipfile.ZipFile(path).namelist()
    assert live(path, canary, "np")
    assert flagged(cli, path) == (1, 1)
    assert "zip readers disagree" in cli("scan", path).stderr


def test_a_second_directory_for_pythons_zipfile_is_walked(tmp_path, cli):
    """zipfile shifts the directory's offset by where the end record sits (`concat`); miniz does not. One file
    then holds two archives: a clean checkpoint for torch, an object array for np.load."""
    canary = tmp_path / "CANARY"
    clean = _stored_zip(_torch_zip_members(tmp_path))
    end = len(clean) - 22
    _, _, _, on_disk, count, cd_size, cd_at, _ = struct.unpack_from("<IHHHHIIH", clean, end)
    npy = object_npy(b"\x80\x02" + payload(canary) + b".")
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0, zlib.crc32(npy), len(npy), len(npy), 8, 0) + \
        b"evil.npy" + npy
    shift = cd_size + len(local)  # zipfile finds its directory right before the end record
    entry = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0, zlib.crc32(npy), len(npy), len(npy),
                        8, 0, 0, 0, 0, 0, cd_at + cd_size - shift) + b"evil.npy"
    pad = cd_size - len(entry)
    second = entry[:32] + struct.pack("<H", pad) + entry[34:] + b" " * pad  # a comment fills it to cd_size
    path = tmp_path / "two_directories.pt"
    path.write_bytes(clean[:end] + local + second + clean[end:])
    assert zipfile.ZipFile(path).namelist() == ["evil.npy"]
    assert torch.load(path, weights_only=True)["w"].shape == (2,)
    assert live(path, canary, "np")
    assert flagged(cli, path) == (1, 1)


def test_an_index_line_cut_at_a_nul_is_read_as_cpython_reads_it(tmp_path, cli):
    """CPython parses `p0\\x00junk` as PUT 0 (its C parser stops at the NUL): the payload after it is named."""
    canary = tmp_path / "CANARY"
    for lead in (b"Np0\x00junk\n0", b"Np0\n0g0\x00junk\n0"):
        body = lead + payload(canary) + b"0}."
        for name, data in {"bare.pkl": body, "legacy.pt": legacy_file(body), "zip.pt": torch_zip(body, {}),
                           "object.npy": object_npy(lead + payload(canary) + b".")}.items():
            path = tmp_path / name
            path.write_bytes(data)
            assert live(path, canary, "np" if name.endswith(".npy") else "path"), (lead, name)
            assert flagged(cli, path) == (1, 1), (lead, name)


def test_a_folder_never_skips_a_file_that_breaks_before_its_first_global(tmp_path, cli):
    """A file is left out of a folder's scan only when nothing in it could be unpickled."""
    canary = tmp_path / "CANARY"
    folder = tmp_path / "run"
    folder.mkdir()
    torch.save({"w": torch.zeros(2)}, folder / "pytorch_model.bin")
    npy = object_npy(b"\x80\x02" + payload(canary) + b".")
    lead = b"PK\x05\x06\n\xff"  # numpy takes it for an .npz; to a pickle reader a PERSID line, then no opcode
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0, zlib.crc32(npy), len(npy), len(npy), 7, 0) + \
        b"arr.npy" + npy
    central = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0, zlib.crc32(npy), len(npy), len(npy),
                          7, 0, 0, 0, 0, 0, len(lead)) + b"arr.npy"
    (folder / "weights.npz").write_bytes(lead + local + central + struct.pack(
        "<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, len(central), len(lead) + len(local), 0))
    assert live(folder / "weights.npz", canary, "np")
    assert cli("scan", folder).exit_code == cli("inspect", folder).exit_code == 1
    os.remove(folder / "weights.npz")
    (folder / "optim.pkl").write_bytes(b"Np0\x00junk\n0" + payload(canary) + b".")
    assert cli("scan", folder).exit_code == cli("inspect", folder).exit_code == 1


def test_an_npz_torch_refuses_is_still_read_as_numpy_reads_it(tmp_path, cli):
    """An end record that names disk 5: torch's reader refuses the archive, Python's zipfile does not care."""
    canary = tmp_path / "CANARY"
    data = bytearray(_stored_zip({"arr.npy": object_npy(b"\x80\x02" + payload(canary) + b".")}))
    struct.pack_into("<HH", data, len(data) - 22 + 4, 5, 5)
    path = tmp_path / "disks.npz"
    path.write_bytes(bytes(data))
    assert live(path, canary, "np")
    assert flagged(cli, path) == (1, 1)


def test_a_global_named_by_bad_text_is_a_clear_error_not_a_crash(tmp_path, cli):
    canary = tmp_path / "CANARY"
    crashes = [b"V\\u12\nV\\u12\n\x93", b"S'\\x'\nS'\\x'\n\x93", b"X\x01\x00\x00\x00\xffX\x01\x00\x00\x00\xff\x93"]
    for i, crash in enumerate(crashes):
        path = tmp_path / f"crash{i}.pkl"
        path.write_bytes(b"\x80\x04" + crash + b".")
        for command in ("scan", "inspect"):
            result = cli(command, path)
            assert result.exit_code == 2 and "internal error" not in result.stderr, (crash, command, result.stderr)
        path = tmp_path / f"after_payload{i}.pt"  # torch runs the payload, then fails on the bad text
        path.write_bytes(torch_zip(b"\x80\x02" + payload(canary) + b"0" + crash + b".", {}))
        assert live(path, canary)
        assert flagged(cli, path) == (1, 1)


@pytest.mark.parametrize("case", ["two checkpoints", "index names a missing shard"])
def test_inspect_of_a_folder_it_cannot_read_still_names_what_its_files_run(tmp_path, cli, case):
    canary = tmp_path / "CANARY"
    folder = tmp_path / "run"
    folder.mkdir()
    torch.save({"w": torch.zeros(2)}, folder / "pytorch_model.bin")
    if case == "two checkpoints":
        torch.save({"w": torch.zeros(2)}, folder / "other.pt")
    else:
        (folder / "pytorch_model.bin.index.json").write_text('{"weight_map": {"w": "gone.bin"}}')
    (folder / "optimizer.pt").write_bytes(b"\x80\x02" + payload(canary) + b".")
    result = cli("inspect", folder)
    assert result.exit_code == cli("scan", folder).exit_code == 1
    assert "posix.system" in result.stderr


def _refused_in_a_child(path, data: bytes, why: str) -> None:
    """`data` as a torch zip's data.pkl: inspect and scan each end in exit 2 and the one line naming `why`. Each
    runs in a process of its own, so that a crash (SIGSEGV) is an exit code to assert on, not pytest's end."""
    path.write_bytes(torch_zip(data, {}))
    for command in ("inspect", "scan"):
        proc = subprocess.run([sys.executable, "-m", "ckpt_doctor", command, str(path)], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2, (command, proc.returncode, proc.stderr[-300:])  # not -11
        assert why in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def _deep_tuple(depth: int) -> bytes:
    return b")" + b"\x85" * depth  # EMPTY_TUPLE wrapped `depth` times by TUPLE1


@pytest.mark.parametrize("how", ["key", "set"])
def test_tuples_nested_too_deep_to_hash_are_refused_not_a_crash(tmp_path, how):
    """Hashing a tuple recurses in C once per level, without a recursion check: a dict key nested a million deep
    (a 1 MB pickle) killed the process with SIGSEGV. The walker bounds how deep tuples nest in tuples."""
    body = {
        "key": b"}" + _deep_tuple(1_000_000) + b"Ns",
        "set": b"}" + _str("s") + global_op("builtins", "set") + b"]" + _deep_tuple(1_000_000) + b"a\x85Rs",
    }[how]
    _refused_in_a_child(tmp_path / "deep.pt", b"\x80\x02" + body + b".",
                        f"tuples nested {limits.MAX_TUPLE_DEPTH + 1:,} deep")


@pytest.mark.parametrize("route", ["build_intlist", "restore_type_tag", "_rebuild_from_type_v2", "persistent id"])
def test_tuples_nested_through_calls_are_refused_not_a_crash(tmp_path, route):
    """An allow-listed call that hands back its argument (torch.jit's build_intlist and restore_type_tag, torch's
    _rebuild_from_type_v2 around one, a legacy ("module", obj) persistent id) starts a tuple's depth again from 0 in
    the walk: one call and one TUPLE1 a level, 400,000 levels, built a dict key whose hash took the process down
    (SIGSEGV). The walk follows a short tuple's items through such calls, and the unpickler measures what they hand
    back; either refuses it."""
    n = 400_000
    marks = limits.MAX_OPEN_MARKS // 2  # a MARK a level, left open: past the depth bound, under the MARKs' own
    build = global_op("torch.jit._pickle", "build_intlist") + b"q\x01"
    body = {
        "build_intlist": build + b"0}" + b"h\x01" * n + b"N" + b"\x85R\x85" * n,
        "restore_type_tag": global_op("torch.jit._pickle", "restore_type_tag") + b"q\x01" + b"0}" + b"h\x01" * n
        + b"N" + b"\x85R\x85" * n,
        "_rebuild_from_type_v2": global_op("torch._tensor", "_rebuild_from_type_v2") + b"q\x02" + b"0" + build
        + b"0}" + b"h\x02(h\x01N]" * marks + b"N" + b"\x85aNtR" * marks,
        "persistent id": b"}" + _str("module") * n + b"N" + b"\x86Q\x85" * n,
    }[route]
    _refused_in_a_child(tmp_path / "laundered.pt", b"\x80\x02" + body + b"Ns.",
                        f"tuples nested {limits.MAX_TUPLE_DEPTH + 1:,} deep")


@pytest.mark.parametrize("how", ["shared parts", "one key set again and again", "set members", "set() of a list",
                                 "OrderedDict() of pairs"])
def test_keys_that_take_billions_of_steps_to_hash_are_refused_not_a_hang(tmp_path, cli, how):
    """Depth bounds one hash's recursion, not its work. A 40-level key of three references to the level below is
    120 bytes and 3**40 tuples to hash (3.11 does not cache a tuple's hash: it ran for hours); a 9,999-deep key set
    two million times in one SETITEMS is 2 * 10**10. The walk counts what hashing the keys visits."""
    body = {
        "shared parts": b"}" + b"N" + b"22\x87" * 40 + b"Ns",
        "one key set again and again": b"}(" + b"N" + b"\x85" * 9_999 + b"q\x01N" + b"h\x01N" * 1_999 + b"u",
        "set members": global_op("builtins", "frozenset") + b"(" + b"N" + b"22\x87" * 30 + b"\x91\x85R",
        "set() of a list": global_op("builtins", "set") + b"]" + b"N" + b"22\x87" * 40 + b"a\x85R",
        "OrderedDict() of pairs": global_op("collections", "OrderedDict") + b"]" + b"N" + b"22\x87" * 40
        + b"K\x01\x86a\x85R",
    }[how]
    path = tmp_path / "flood.pt"
    path.write_bytes(torch_zip(b"\x80\x02" + body + b".", {}))
    for command in ("inspect", "scan"):
        result = cli(command, path)
        assert result.exit_code == 2, (command, result.stderr)
        assert f"add up to more than {limits.MAX_HASHED_TUPLES:,} tuples to hash" in result.stderr, result.stderr
        assert result.stderr.count("\n") == 1


def _ints_of_one_hash(count: int) -> list[bytes]:
    """`count` ints k * (2**61 - 1), which CPython hashes alike (to 0), as LONG1 opcodes."""
    return [pickle.dumps(k * ((1 << 61) - 1), 2)[2:-1] for k in range(1, count + 1)]


def _handed_to(call: bytes, container: bytes, times: int) -> bytes:
    """`container` (one value), then a list of `times` calls of `call` on it, through the memo."""
    return call + b"q\x010" + container + b"q\x020(" + b"h\x01h\x02\x85R" * times + b"l"


_ONE_HASH = limits.MAX_KEYS_OF_ONE_HASH + 1
_AGAIN = limits.MAX_HASH_WORK // 10_000 + 1  # calls on a 10,000-item container
_FLOODS = {  # name -> (the object pickle's body, what the one stderr line names)
    "MARKs left open": (b"(" * (limits.MAX_OPEN_MARKS + 1) + b"N", f"more than {limits.MAX_OPEN_MARKS:,} MARKs open"),
    "dict keys of one hash": (b"}(" + b"N".join(_ints_of_one_hash(_ONE_HASH)) + b"Nu",
                              "dict keys or set members of one hash"),
    "set() of ints of one hash": (global_op("builtins", "set") + b"(" + b"".join(_ints_of_one_hash(_ONE_HASH))
                                  + b"l\x85R", "distinct items of one hash"),
    "one list handed to set() again and again": (
        _handed_to(global_op("builtins", "set"), b"(" + b"M\x00\x01" * 10_000 + b"l", _AGAIN),
        f"hash more than {limits.MAX_HASH_WORK:,} items"),
    "one dict handed to OrderedDict() again and again": (
        _handed_to(global_op("collections", "OrderedDict"), b"}(" + b"".join(b"M" + struct.pack("<H", i) + b"N"
                                                                            for i in range(10_000)) + b"u", _AGAIN),
        f"hash more than {limits.MAX_HASH_WORK:,} items"),
    "what build_intlist hands back, a key again and again": (
        b"}" + global_op("torch.jit._pickle", "build_intlist") + b")q\x000" + b"h\x00h\x00h\x00\x87q\x000" * 7
        + b"h\x00\x85Rq\x010(" + b"h\x01N" * 10_000 + b"u",
        f"more than {limits.MAX_HASHED_TUPLES:,} tuples to hash"),
    "complex() results of one hash as dict keys": (  # hash(complex(x, y)) = hash(x) + 1000003 * hash(y)
        global_op("builtins", "complex") + b"q\x010}(" + b"".join(
            b"h\x01G" + struct.pack(">d", 1000003.0 * (_ONE_HASH - t)) + b"G" + struct.pack(">d", float(t)) + b"\x86RN"
            for t in range(_ONE_HASH)) + b"u", f"more than {limits.MAX_KEYS_OF_ONE_HASH:,} distinct values of one hash"),
}


@pytest.mark.parametrize("how", list(_FLOODS))
def test_floods_through_the_memo_and_calls_end_in_a_named_refusal(tmp_path, cli, how):
    """Work the opcodes do not show: 120 million MARKs cost the walk 1.2 GB; ints that hash alike take CPython
    quadratic time to insert (30,000 took 23 s); a container handed to set() or OrderedDict() through the memo, or
    a tuple a call hands back used as a key, is hashed again at every use. Each is refused by a bound of its own
    (limits.py), with one line naming it."""
    body, why = _FLOODS[how]
    path = tmp_path / "flood.pt"
    path.write_bytes(torch_zip(b"\x80\x02" + body + b".", {}))
    for command in ("inspect", "scan"):
        result = cli(command, path)
        assert result.exit_code == 2, (command, result.stderr)
        assert why in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_a_dict_shared_by_many_entries_is_not_called_an_attack(tmp_path, cli):
    """An honest tree that shares one metadata dict across many entries (the pickler's memo) is counted each place
    it appears; past the bound it is refused in words that do not call it a bomb."""
    meta = {f"k{i}": i for i in range(1_000)}
    torch.save({"w": torch.zeros(2), "groups": [meta] * 1_000}, tmp_path / "shared.pt")
    for command in ("inspect", "scan"):
        result = cli(command, tmp_path / "shared.pt")
        assert result.exit_code in (0, 2), result.stderr
        assert "bomb" not in result.stderr and "attack" not in result.stderr, result.stderr


def test_honest_tuple_keys_are_hashed_without_a_refusal(tmp_path, cli):
    """What torch.save writes for a dict keyed by tuples, shared ones included, is far under the bound."""
    pair = (("layer", 1), ("layer", 2))
    torch.save({"w": torch.zeros(1), "index": {(pair, i): i for i in range(50_000)}, "again": {pair: [pair] * 100}},
               tmp_path / "keys.pt")
    result = cli("inspect", tmp_path / "keys.pt")
    assert result.exit_code == 0, result.stderr


def _tagged(t: torch.Tensor) -> torch.Tensor:
    t.tag = "x"  # a Python attribute: torch.save writes _rebuild_from_type_v2(func, Tensor, args, state)
    return t


@pytest.mark.parametrize("what", ["plain", "pairs, protocol 1", "tensors with attributes"])
def test_honest_nesting_and_many_tensors_are_not_taken_for_deep_tuples(tmp_path, cli, what):
    """The bound is on tuples nested in tuples, not on how many tuples or calls a pickle has: 12,000 tensors
    of each layout torch.save writes pass, and so does what Python pickles nested 200 deep (its pickler stops
    near 1,000), which CPython reads back."""
    n = 12_000
    path = tmp_path / "many.pt"
    if what == "plain":
        nested: object = ()
        for _ in range(200):
            nested = (nested, 1)
        torch.save({**{f"w{i}": torch.zeros(1) for i in range(n)}, "meta": {nested: "key"}}, path)
        assert walk(pickle.dumps({nested: [nested, {nested}]}, protocol=2), "p").refused is None
        assert pickle.loads(pickle.dumps({nested: 1}))  # CPython reads it: nothing to refuse
    elif what == "pairs, protocol 1":
        torch.save({"pairs": [(f"k{i}", torch.zeros(1)) for i in range(n)]}, path, pickle_protocol=1)
    else:
        torch.save({f"t{i}": _tagged(torch.zeros(1)) for i in range(n)}, path)
    result = cli("inspect", path, "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json()["tensor_count"] == n


def test_a_pickle_cannot_rebind_a_torch_dtype_for_the_rest_of_the_file(tmp_path, cli):
    """torch.float32 is one object for every mention of it; BUILD with slot state would have changed it for every
    tensor after (and put a 3**40-leaf tuple in the report). torch's dtypes take no state: the file fails to read."""
    shared = b"N" + b"22\x87" * 40  # a tuple sharing its parts 40 levels deep (three references to each level)
    data = (b"\x80\x02}" + _str("a") + global_op("torch", "float32") + b"N}" + _str("value") + shared + b"s\x86b"
            + b"s.")
    path = tmp_path / "token.pt"
    path.write_bytes(torch_zip(data, {}))
    result = cli("inspect", path)
    assert result.exit_code == 2
    assert "torch.float32 cannot be given state" in result.stderr and result.stderr.count("\n") == 1


def test_an_unexpected_persistent_id_is_named_briefly(tmp_path, cli):
    """Its note shows at most 80 characters, made without building the whole repr (3**14 leaves, 300 times)."""
    shared = b"N" + b"22\x87" * 14
    path = tmp_path / "persid.pt"
    path.write_bytes(torch_zip(b"\x80\x02" + shared + b"q\x010" + b"h\x01Q0" * 300 + b"N.", {}))
    result = cli("scan", path, "--json")
    notes = [n for f in result.json()["files"] for n in f["notes"] if "unexpected persistent id" in n]
    assert notes and all(len(n) <= len("unexpected persistent id ") + 80 for n in notes)


def test_a_chain_of_slices_is_refused_not_a_crash(tmp_path):
    """builtins.slice is on torch's allow-list and really called; CPython frees a slice without the trashcan that
    tuples and lists use, so slice(slice(slice(...))) 300,000 deep took the process down (SIGSEGV) when freed."""
    depth = 300_000
    data = (b"\x80\x02" + global_op("builtins", "slice") + b"q\x00" + b"h\x00" * (depth - 1) + b"N" + b"\x85R" * depth
            + b".")
    _refused_in_a_child(tmp_path / "slices.pt", data, "a slice of slices")
