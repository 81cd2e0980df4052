"""Generates the malicious and the broken corpora: every sample is built here, at test time, from opcodes.

Each malicious sample, if it were ever unpickled for real, would create the canary file (or do something as
visible), so its absence after every command proves nothing ran.
"""

from __future__ import annotations

import io
import json
import marshal
import os
import struct
import zlib
from pathlib import Path

from tests.payloads import _str, call, global_op, stored_zip, torch_zip


def _proto(n: int) -> bytes:
    return b"\x80" + bytes([n])


def _binunicode(s: str) -> bytes:
    return _str(s)


def _short(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b


def _text_str(s: str) -> bytes:  # protocol 0 STRING
    return b"S'" + s.encode() + b"'\n"


def _tensor_dict(payload: bytes) -> bytes:
    """A state_dict with one real tensor entry and the payload under "x" (protocol 2)."""
    tensor = (global_op("torch._utils", "_rebuild_tensor_v2") + b"((" + _str("storage") +
              global_op("torch", "FloatStorage") + _str("0") + _str("cpu") + b"K\x04tQK\x00K\x04\x85K\x01\x85\x89" +
              global_op("collections", "OrderedDict") + b")RtR")
    return _proto(2) + b"}(" + _str("w") + tensor + _str("x") + payload + b"u."


def malicious(canary: Path, legacy_template: bytes) -> dict[str, bytes]:
    c = str(canary)
    sh = f"touch {c}"
    py = f"__import__('os').system('touch {c}')"
    code = compile(f"import os\nos.system('touch {c}')", "<payload>", "exec")
    samples: dict[str, bytes] = {
        "p0_global_reduce.pkl": b"cos\nsystem\n(" + _text_str(sh) + b"tR.",
        "p1_binary.pkl": b"cposix\nsystem\n(X" + struct.pack("<I", len(sh)) + sh.encode() + b"tR.",
        "p2_os_system.pkl": _proto(2) + call("os", "system", sh) + b".",
        "p3_subprocess.pkl": _proto(3) + global_op("subprocess", "Popen") + b"](" + _str("touch") + _str(c) +
                             b"e\x85R.",
        "p4_stack_global.pkl": _proto(4) + _short("posix") + _short("system") + b"\x93(" + _binunicode(sh) + b"tR.",
        "p5_frame.pkl": _framed(_short("os") + _short("system") + b"\x93" + _binunicode(sh) + b"\x85R."),
        "inst_opcode.pkl": b"(" + _text_str(sh) + b"ios\nsystem\n.",
        "obj_opcode.pkl": _proto(2) + b"(" + global_op("os", "system") + _str(sh) + b"o.",
        "obj_then_pop.pkl": _proto(2) + b"}(" + b"(" + global_op("os", "system") + _str(sh) + b"o0" + b"u.",
        "memo_trick.pkl": _proto(2) + global_op("os", "system") + b"q\x07" + b"0" + b"h\x07(" + _str(sh) + b"tR.",
        "stack_global_memo.pkl": _proto(4) + _short("os") + b"\x94" + _short("system") + b"\x94" + b"h\x00h\x01\x93(" +
                                 _binunicode(sh) + b"tR.",
        "builtins_eval.pkl": _proto(2) + call("builtins", "eval", py) + b".",
        "builtins_exec.pkl": _proto(2) + call("builtins", "exec", py) + b".",
        "getattr_import.pkl": _proto(2) + global_op("builtins", "getattr") + b"("
                              + call("builtins", "__import__", "os") + _str("system") + b"tR(" + _str(sh) + b"tR.",
        "dunder_import.pkl": _proto(2) + global_op("__builtin__", "__import__") + b"(" + _str("os") + b"tR.",
        "importlib.pkl": _proto(2) + call("importlib", "import_module", "os") + b".",
        "pkgutil_resolve.pkl": _proto(2) + call("pkgutil", "resolve_name", "os:system") + b"(" + _str(sh) + b"tR.",
        "pydoc_locate.pkl": _proto(2) + call("pydoc", "locate", "os.system") + b"(" + _str(sh) + b"tR.",
        "attrgetter.pkl": _proto(2) + call("operator", "attrgetter", "system") + b"(" +
                          call("builtins", "__import__", "os") + b"tR.",
        "methodcaller.pkl": _proto(2) + global_op("operator", "methodcaller") + b"(" + _str("system") + _str(sh) +
                            b"tR(" + call("importlib", "import_module", "os") + b"tR.",
        "functools_partial.pkl": _proto(2) + global_op("functools", "partial") + b"(" + global_op("os", "system") +
                                 _str(sh) + b"tR)R.",
        "marshal_function.pkl": _proto(2) + global_op("types", "FunctionType") + b"(" + global_op("marshal", "loads") +
                                b"(" + b"C" + bytes([0]) + b"tR" + b"}tR)R.",
        "codecs_open.pkl": _proto(2) + call("codecs", "open", c, "w") + b".",
        "posixsubprocess.pkl": _proto(2) + call("_posixsubprocess", "fork_exec", "/usr/bin/touch") + b".",
        "runpy.pkl": _proto(2) + call("runpy", "run_path", "/dev/null") + b".",
        "webbrowser.pkl": _proto(2) + call("webbrowser", "open", "http://127.0.0.1:9/") + b".",
        "shutil_rmtree.pkl": _proto(2) + call("shutil", "rmtree", str(canary.parent / "nothing-here")) + b".",
        "socket.pkl": _proto(2) + global_op("socket", "create_connection") + b"((" + _str("127.0.0.1") + b"K\x09ttR.",
        "nested_pickle_loads.pkl": _proto(2) + global_op("pickle", "loads") + b"(B" +
                                   struct.pack("<I", len(_proto(2) + call("os", "system", sh) + b".")) +
                                   _proto(2) + call("os", "system", sh) + b".tR.",
        "nested_torch_load.pkl": _proto(2) + call("torch", "load", c) + b".",
        "torch_load_from_bytes.pkl": _proto(2) + global_op("torch.storage", "_load_from_bytes") + b"(C" +
                                     bytes([len(_proto(2) + b"N.")]) + _proto(2) + b"N.tR.",
        "concatenated.pkl": _proto(2) + b"}." + _proto(2) + call("os", "system", sh) + b".",
        "state_dict_payload.pt": torch_zip(_tensor_dict(call("os", "system", sh)), {"0": b"\0" * 16}),
        "zip_extra_member.pt": _zip_with_extra(_tensor_dict(b"N"), _proto(2) + call("os", "system", sh) + b"."),
        "zip_after_stop.pt": torch_zip(_tensor_dict(b"N") + _proto(2) + call("os", "system", sh) + b".",
                                       {"0": b"\0" * 16}),
        "pickle_then_zip.pt": _proto(2) + call("os", "system", sh) + b"." +
                              torch_zip(_tensor_dict(b"N"), {"0": b"\0" * 16}),
        "legacy_object_payload.pt": _legacy_with_payload(legacy_template, call("os", "system", sh)),
        "torchscript_constants.pt": stored_zip({"m/data.pkl": _tensor_dict(b"N"), "m/data/0": b"\0" * 16,
                                                  "m/constants.pkl": _proto(2) + call("os", "system", sh) + b".",
                                                  "m/code/__torch__.py": b"class M(Module):\n  pass\n"}),
        "asyncio_subprocess.pkl": _proto(2) + call("asyncio", "create_subprocess_shell", sh) + b".",
        "sys_modules.pkl": _proto(2) + global_op("sys", "modules") + b".",
        "marshal_code.pkl": _proto(2) + global_op("marshal", "loads") + b"(C"
                            + bytes([min(len(marshal.dumps(code)), 255)]) + marshal.dumps(code)[:255] + b"tR.",
    }
    return samples


def _framed(body: bytes) -> bytes:
    return _proto(5) + b"\x95" + struct.pack("<Q", len(body)) + body


def _zip_with_extra(main: bytes, extra: bytes) -> bytes:
    return stored_zip({"archive/data.pkl": main, "archive/data/0": b"\0" * 16, "archive/extra.pkl": extra,
                         "archive/version": b"3\n"})


def _legacy_with_payload(template: bytes, payload: bytes) -> bytes:
    import pickletools

    f = io.BytesIO(template)
    starts = []
    for _ in range(5):
        starts.append(f.tell())
        for _op in pickletools.genops(f):
            pass
    starts.append(f.tell())
    obj = _proto(2) + b"}(" + _str("x") + payload + b"u."
    return template[:starts[3]] + obj + template[starts[4]:]


def broken(tmp: Path, good_zip: bytes, good_legacy: bytes, good_st: bytes) -> dict[str, bytes | None]:
    """name -> bytes (None for samples that are not plain files: made by `make_special`)."""
    n = len(good_zip)
    st_header_len = struct.unpack("<Q", good_st[:8])[0]
    header = json.loads(good_st[8:8 + st_header_len])

    def st(header_obj: dict, data: bytes, raw: bytes | None = None) -> bytes:
        h = raw if raw is not None else json.dumps(header_obj).encode()
        return struct.pack("<Q", len(h)) + h + data

    key = next(k for k in header if k != "__metadata__")
    data = good_st[8 + st_header_len:]
    overlap = json.loads(json.dumps(header))
    overlap[key]["data_offsets"] = [0, overlap[key]["data_offsets"][1]]
    keys = [k for k in header if k != "__metadata__"]
    overlap[keys[1]]["data_offsets"] = [0, header[keys[1]]["data_offsets"][1] - header[keys[1]]["data_offsets"][0]]
    out_of_range = json.loads(json.dumps(header))
    out_of_range[key]["data_offsets"] = [0, len(data) + 100]
    size_mismatch = json.loads(json.dumps(header))
    size_mismatch[key]["shape"] = [999]
    big_inflate = _deflated_bomb()
    samples: dict[str, bytes | None] = {
        "empty.pt": b"",
        "one_byte.pt": b"\x80",
        "seven_bytes.safetensors": b"\x08\0\0\0\0\0\0",
        "zip_cut_10.pt": good_zip[: n // 10],
        "zip_cut_50.pt": good_zip[: n // 2],
        "zip_cut_90.pt": good_zip[: n * 9 // 10],
        "zip_cut_last_byte.pt": good_zip[:-1],
        "zip_no_central_dir.pt": good_zip[: good_zip.rfind(b"PK\x01\x02")],
        "zip_flipped_cd.pt": _flip(good_zip, good_zip.rfind(b"PK\x01\x02") + 20),
        "zip_bad_crc_data_pkl.pt": _flip(good_zip, good_zip.find(b"data.pkl") + 80),
        "zip_local_header_gone.pt": good_zip.replace(b"PK\x03\x04", b"XX\x03\x04", 1),
        "zip_without_data_pkl.pt": stored_zip({"a/readme.txt": b"hello"}),
        "zip_two_data_pkl.pt": stored_zip({"a/data.pkl": b"\x80\x02}.", "b/data.pkl": b"\x80\x02}."}),
        "zip_deflate_bomb.pt": big_inflate,
        "legacy_cut_object.pt": good_legacy[:300],
        "legacy_cut_storage.pt": good_legacy[:-40],
        "legacy_bad_version.pt": good_legacy.replace(b"M\xe9\x03", b"M\xea\x03", 1),
        "st_header_past_end.safetensors": struct.pack("<Q", 10_000) + b"{}",
        "st_header_over_100mb.safetensors": struct.pack("<Q", 200_000_000) + b"{" + b" " * 64,
        "st_non_utf8.safetensors": st({}, b"", raw=b'{"a\xff\xfe": 1}'),
        "st_non_json.safetensors": st({}, b"", raw=b"{not json at all}"),
        "st_overlap.safetensors": st(overlap, data),
        "st_out_of_range.safetensors": st(out_of_range, data),
        "st_trailing_bytes.safetensors": good_st + b"\0" * 16,
        "st_size_mismatch.safetensors": st(size_mismatch, data),
        "st_bad_dtype.safetensors": st({"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}, b"\0"),
        "png_named_pt.pt": b"\x89PNG\r\n\x1a\n" + b"\0" * 64,
        "gzip_named_pt.pt": b"\x1f\x8b\x08\x00" + b"\0" * 64,
        "html.bin": b"<!DOCTYPE html><html><body>Not found</body></html>",
        "random.bin": bytes((i * 7919 + 13) % 256 for i in range(4096)),
        "pickle_bomb.pkl": _expansion_bomb(),
        "pickle_deep.pkl": b"\x80\x02" + b"(" * 100_000 + b"l" * 100_000 + b".",
        "memo_huge_index.pkl": b"\x80\x02Nr\xff\xff\xff\x7f.",
        "tensor_past_storage.pt": torch_zip(_proto(2) + global_op("torch._utils", "_rebuild_tensor_v2") +
                                            b"((" + _str("storage") + global_op("torch", "FloatStorage") + _str("0") +
                                            _str("cpu") + b"K\x02tQK\x00K\x08\x85K\x01\x85\x89" +
                                            global_op("collections", "OrderedDict") + b")RtR.", {"0": b"\0" * 8}),
        "dangling_symlink.pt": None,
        "empty_folder": None,
    }
    return samples


def make_special(tmp: Path, name: str) -> Path:
    path = tmp / name
    if name == "dangling_symlink.pt":
        os.symlink(tmp / "does-not-exist.pt", path)
    elif name == "empty_folder":
        path.mkdir()
        (path / "notes.txt").write_text("no checkpoint here")
    return path


def _flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at % len(b)] ^= 0xFF
    return bytes(b)


def _deflated_bomb() -> bytes:
    """A zip whose data.pkl inflates to 1 GB of zeros (from about 1 MB)."""
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    chunk = b"\0" * (1 << 20)
    body = b"".join(comp.compress(chunk) for _ in range(1024)) + comp.flush()
    name = b"bomb/data.pkl"
    crc = 0
    size = 1 << 30
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 8, 0, 0, crc, len(body), size, len(name), 0) + name
    central = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 8, 0, 0, crc, len(body), size, len(name), 0, 0,
                          0, 0, 0, 0) + name
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, len(central), len(local) + len(body), 0)
    return local + body + central + end


def _expansion_bomb() -> bytes:
    """Billion laughs: each list holds the previous one ten times (only references: small pickle, huge tree)."""
    out = bytearray(b"\x80\x02]q\x00")
    for i in range(1, 30):
        out += b"](" + (b"h" + bytes([i - 1])) * 10 + b"eq" + bytes([i])
    return bytes(out) + b"."


def resource_attacks() -> dict[str, bytes]:
    """Small files that would cost unbounded time or memory to a naive reader (each named in issue 11)."""
    # _rebuild_tensor_v2(storage, 0, (1,), (1,), False, OrderedDict()), every global and the storage memoized
    tensor = b"h\x01(h\x02K\x00K\x01\x85K\x01\x85\x89h\x03)RtR"

    storage = (global_op("torch._utils", "_rebuild_tensor_v2") + b"q\x01" + b"(" + _str("storage") +
               global_op("torch", "FloatStorage") + _str("0") + _str("cpu") + b"K\x04tQq\x02" + b"0" +
               global_op("collections", "OrderedDict") + b"q\x03" + b"0")
    many = 600_000  # over limits.MAX_TENSORS (issue 11 measured 900,000: 21 s and 1.8 GB before)
    shared_storage = bytearray(_proto(2) + storage + b"}(")
    for i in range(many):
        shared_storage += _str(f"t{i}") + tensor
        if i % 1000 == 999:
            shared_storage += b"u("
    shared_storage += b"u."
    key = "k" * (1 << 20)
    nested_key = _proto(2) + _str(key) + b"q\x00" + b"}" + (b"h\x00}" * 2000) + b"s" * 2000 + b"."
    big_int = _proto(2) + b"}(" + _str("n") + b"\x8b" + struct.pack("<i", 4 << 20) + b"\x7f" * (4 << 20) + b"u."
    huge_shape = _proto(2) + global_op("torch._utils", "_rebuild_tensor_v2") + b"((" + _str("storage") + \
        global_op("torch", "FloatStorage") + _str("0") + _str("cpu") + b"K\x04tQK\x00" + b"\x8a\x20" + b"\x7f" * 32 + \
        b"\x85K\x01\x85\x89" + global_op("collections", "OrderedDict") + b")RtR."
    deep = b"\x80\x02" + b"(" * 200_000 + b"l" * 200_000 + b"."  # lists nested 200,000 deep
    return {
        "memo_index_bomb.pkl": b"\x80\x02Nr\xff\xff\xff\x7f.",
        "laughs.pkl": _expansion_bomb(),
        "nested_key.pkl": nested_key,
        "deflate_bomb.pt": _deflated_bomb(),
        "many_deflated_members.pt": _many_deflated(),
        "shared_storage_600k.pt": torch_zip(bytes(shared_storage), {"0": b"\0" * 16}),
        "big_int.pkl": big_int,
        "huge_shape.pt": torch_zip(huge_shape, {"0": b"\0" * 16}),
        "deep_marks.pkl": deep,
        "st_5000_digits.safetensors": _st_raw(b'{"a":{"dtype":"F32","shape":[' + b"9" * 5000
                                              + b'],"data_offsets":[0,4]}}'),
        "st_deep.safetensors": _st_raw(b'{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}"),
        "st_wrong_types.safetensors": _st_raw(b'{"a":{"dtype":["F32"],"shape":{"x":1},"data_offsets":"0,4"}}'),
        "st_surrogate.safetensors": _st_raw(b'{"\\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'),
        "st_metadata_types.safetensors": _st_raw(b'{"__metadata__":[1,2],"a":{"dtype":"F32","shape":[1],'
                                                 b'"data_offsets":[0,4]}}'),
        "st_600k_entries.safetensors": _st_raw(b"{" + b",".join(b'"%x":{"dtype":"F32","shape":[0],'
                                                                  b'"data_offsets":[0,0]}' % i
                                                                  for i in range(600_000)) + b"}"),
        "none_pop_40mb.pkl": b"\x80\x02" + b"N0" * 20_000_000 + b"N.",
        "zip_700k_members.pt": _zip_many_members(700_000),
    }


def slow_inputs() -> dict[str, bytes]:
    """Valid files that once took minutes or gigabytes to list (quadratic paths): they must list quickly."""
    keys = b"".join(_str(str(2 * i)) + b"h\x04" + _str(f"a{i}") + b"h\x04" for i in range(30_000))
    tensor = (global_op("torch._utils", "_rebuild_tensor_v2") + b"((" + _str("storage") +
              global_op("torch", "FloatStorage") + _str("0") + _str("cpu") + b"K\x00tQK\x00K\x00\x85K\x01\x85\x89" +
              global_op("collections", "OrderedDict") + b")RtRq\x04")
    return {
        "devices_40k.pt": torch_zip(_devices_pickle(40_000), {"0": b"\0" * 4}),
        "labels_60k.pt": torch_zip(_proto(2) + tensor + b"0}(" + keys + b"u.", {"0": b""}),
        # one allow-listed global named 1,000,000 times (each lookup was once a new record: 2M took 12 s, 615 MB)
        "globals_1m.pkl": _proto(2) + global_op("collections", "OrderedDict") * 1_000_000 + b"0" * 999_999 + b".",
    }


def _zip_many_members(n: int) -> bytes:
    """A torch zip whose central directory lists `n` more members, all pointing at one local header."""
    base = torch_zip(_proto(2) + b"}.", {})
    end = base.rindex(b"PK\x05\x06")
    cd_size, cd_at = struct.unpack_from("<II", base, end + 12)
    first = base[cd_at:cd_at + 46 + struct.unpack_from("<H", base, cd_at + 28)[0]]
    extra = b"".join(first[:28] + struct.pack("<H", len(b"archive/e%d" % i)) + first[30:46] + b"archive/e%d" % i
                     for i in range(n))
    count = struct.unpack_from("<H", base, end + 10)[0] + n
    central = base[cd_at:cd_at + cd_size] + extra
    tail = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    z64 = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, len(central), cd_at)
    locator = struct.pack("<IIQI", 0x07064B50, 0, cd_at + len(central), 1)
    return base[:cd_at] + central + z64 + locator + tail


def _devices_pickle(n: int) -> bytes:
    """`n` tensors on one 4-byte storage, each moved to its own device by an allow-listed rebuild function."""
    tensor = (global_op("torch._utils", "_rebuild_tensor_v2") + b"((" + _str("storage") +
              global_op("torch", "FloatStorage") + _str("0") + _str("cpu") + b"K\x01tQK\x00K\x01\x85K\x01\x85\x89" +
              global_op("collections", "OrderedDict") + b")RtR")
    out = bytearray(_proto(2) + global_op("torch._utils", "_rebuild_device_tensor_from_cpu_tensor") + b"q\x000" +
                    global_op("torch", "device") + b"q\x010" + global_op("torch", "float32") + b"q\x020}(")
    for i in range(n):
        out += _str(f"t{i}") + b"h\x00(" + tensor + b"h\x02h\x01" + _str(f"xla:{i}") + b"\x85R\x89tR"
        if i % 1000 == 999:
            out += b"u("
    return bytes(out + b"u.")


def sparse_attacks(folder: Path) -> list[Path]:
    """Files of hundreds of MB that cost no disk (holes): a 300 MB byte string, a tar with a 900 MB PAX header."""
    big = folder / "big_string.pkl"
    with open(big, "wb") as f:
        f.write(_proto(2) + b"\x8e" + struct.pack("<Q", 300 << 20))
        f.truncate(f.tell() + (300 << 20))
        f.seek(0, 2)
        f.write(b".")
    pax = folder / "pax_900mb.tar"
    size = 900_000_000
    header = bytearray(512)
    header[:14] = b"././@PaxHeader"
    header[124:136] = b"%011o\0" % size
    header[156:157] = b"x"
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    with open(pax, "wb") as f:
        f.write(bytes(header))
        f.truncate(512 + size + 1024)
    return [big, pax]


def _st_raw(header: bytes) -> bytes:
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + b"\0" * 4


def _many_deflated() -> bytes:
    """Many members that each inflate to 200 MB of zeros from ~200 KB: 8 GB in all from under 2 MB."""
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    chunk = b"\0" * (1 << 20)
    body = b"".join(comp.compress(chunk) for _ in range(200)) + comp.flush()
    size = 200 << 20
    crc = zlib.crc32(b"\0" * size)
    buf = io.BytesIO()
    central = b""
    for i in range(40):
        name = f"bomb/x{i}.pkl".encode()
        at = buf.tell()
        buf.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 8, 0, 0, crc, len(body), size, len(name), 0) + name)
        buf.write(body)
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 8, 0, 0, crc, len(body), size, len(name),
                               0, 0, 0, 0, 0, at) + name
    cd_at = buf.tell()
    buf.write(central)
    buf.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 40, 40, len(central), cd_at, 0))
    return buf.getvalue()


# --- side effects of torch's own load path (issue 24) -----------------------------------------------------------

def _state(dict_state: dict[str, bytes] | None, slots: dict[str, bytes] | None = None) -> bytes:
    """BUILD's argument: a dict state, and a slot state (which BUILD sets with setattr) when given."""
    def as_dict(items: dict[str, bytes] | None) -> bytes:
        return b"}(" + b"".join(_str(k) + v for k, v in items.items()) + b"u" if items else b"N"

    return as_dict(dict_state) + (as_dict(slots) + b"\x86" if slots is not None else b"")


def _patching(target: str) -> bytes:
    """BUILD's argument that makes `_check_container_source` write `target.patch`: dump_patches and __name__ set by
    setattr (a function's __name__ is no __dict__ entry; a class's __dict__ cannot be updated at all)."""
    return _state(None, {"dump_patches": b"\x88", "__name__": _str(target)})


def module_record(memo: int, source: str = "class Evil:\n    pass\n") -> bytes:
    """torch's legacy persistent id ("module", container, source file, source), the container from memo `memo`."""
    return b"(" + _str("module") + b"h" + bytes([memo]) + _str("evil.py") + _str(source) + b"tQ"


def side_effect_routes(target: str) -> dict[str, tuple[str, bytes, str]]:
    """name -> (format, payload, effect): each route by which torch.load(weights_only=False) changes the process or
    writes a file while naming only allow-listed globals. `payload` is an entry of the object pickle (opcodes that
    leave one value) for "legacy" and "zip", the whole `pickle` member for "tar", the whole sys-info pickle for
    "legacy-sysinfo". `effect` is a Python expression that is true in the loading process once the route fired
    (`target` is where a written .patch file lands)."""
    patch = f"os.path.exists({target + '.patch'!r})"
    rebuild = global_op("torch._utils", "_rebuild_tensor_v2")
    enum = global_op("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")
    member = "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING(1).__dict__.get('pwned', False)"
    routes: dict[str, tuple[str, bytes, str]] = {}
    for module, name in [("torch._utils", "_rebuild_tensor_v2"), ("torch._tensor", "_rebuild_from_type_v2"),
                         ("copyreg", "_reconstructor"), ("torch.jit._pickle", "build_intlist"),
                         ("argparse", "Namespace")]:
        routes[f"BUILD on {module}.{name}"] = (
            "legacy", global_op(module, name) + b"q\x10" + _patching(target) + b"b0" + module_record(0x10), patch)
    routes["BUILD with a dict state (the .patch file in the working folder)"] = (
        "legacy", global_op("copyreg", "_reconstructor") + b"q\x10" + _state({"dump_patches": b"\x88"}) + b"b0"
        + module_record(0x10), "os.path.exists('_reconstructor.patch')")
    routes["BUILD on what build_intlist hands back"] = (
        "legacy", global_op("torch.jit._pickle", "build_intlist") + b"q\x110" + rebuild + b"q\x10" + b"0h\x11h\x10\x85R"
        + _patching(target) + b"b0" + module_record(0x10), patch)
    routes["BUILD on what a module record hands back"] = (
        "legacy", rebuild + b"q\x100(" + _str("module") + b"h\x10" + _str("") + _str("") + b"tQ" + _patching(target)
        + b"b0" + module_record(0x10), patch)
    routes["BUILD on a global named by STACK_GLOBAL and copied by DUP"] = (
        "legacy", _short("torch._utils") + _short("_rebuild_tensor_v2") + b"\x93q\x102" + _patching(target) + b"b00"
        + module_record(0x10), patch)
    routes["BUILD in the system-info pickle, the module record in the object pickle"] = (
        "legacy-sysinfo", _proto(2) + rebuild + _patching(target) + b"b0}.", patch)
    routes["a tar persistent id (container, source file, source)"] = (
        "tar", _proto(2) + b"}(" + _str("x") + rebuild + b"q\x10" + _patching(target) + b"b0(h\x10" + _str("evil.py")
        + _str("class Evil:\n    pass\n") + b"tQu.", patch)
    routes["BUILD on a function (zip: no .patch, the process changed)"] = (
        "zip", rebuild + _state({"pwned": b"\x88"}) + b"b",
        "getattr(torch._utils._rebuild_tensor_v2, 'pwned', False)")
    routes["BUILD on an enum member an allowed enum class returns"] = (
        "zip", enum + b"K\x01\x85R" + _state({"pwned": b"\x88"}) + b"b", member)
    routes["_rebuild_from_type_v2 setting attributes on what its function returns"] = (
        "zip", global_op("torch._tensor", "_rebuild_from_type_v2") + b"(" + enum + enum + b"K\x01\x85"
        + _state({"pwned": b"\x88"}) + b"tR", member)
    return routes
