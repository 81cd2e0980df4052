"""Every bound ckpt-doctor puts on what a file can make it do: each input ends in seconds, in bounded memory.

The promise (docs/security.md): any file — hostile or broken — ends within 30 s and 1 GB of peak RSS with exit
1 or 2 and a named error. Each limit below says why it is where it is. Bounds that scale with the input are
written as functions of its length, so a big honest file is never refused for its size alone.
"""

from __future__ import annotations

# --- pickles -------------------------------------------------------------------------------------------------

# A pickler numbers its memo from 0 and spends at least two bytes per PUT, so an honest pickle of n bytes never
# uses a memo index past n. CPython's unpickler allocates its memo array up to the largest index it sees: a 9-byte
# pickle with LONG_BINPUT 0x7fffffff costs 16 GB there. Such a pickle is refused before it is unpickled.
def max_memo_index(pickle_length: int) -> int:
    return pickle_length


# An integer of more bytes than this is no checkpoint's: Python writes ints over 255 bytes as LONG4, and turning a
# multi-megabyte one into text (a JSON report) would hit CPython's 4,300-digit limit or take minutes.
MAX_INT_BYTES = 1024

# Memo entries one pickle may store: a 20,000-tensor data.pkl stores 160,000; 15 million (74 MB of LONG_BINPUTs)
# took 1.4 GB to track. A bigger pickle may honestly store more: torch's DCP `.metadata` (protocol 4, a MEMOIZE after
# almost every object) stores one entry per 8.6 bytes, 16 million for 1,000,000 chunks in 138 MB. So the bound grows
# with the pickle's length, one entry per MEMO_BYTES_PER_ENTRY bytes past MAX_MEMO_ENTRIES: a bomb still pays at least
# that many bytes of file per entry it makes the walk track, and the pickle's length is itself bounded (a pickle over
# MAX_UNPICKLE_BYTES is not unpickled; the walk stops at MAX_PICKLE_OPCODES).
MAX_MEMO_ENTRIES = 2_000_000
MEMO_BYTES_PER_ENTRY = 6


def max_memo_entries(pickle_length: int) -> int:
    return max(MAX_MEMO_ENTRIES, pickle_length // MEMO_BYTES_PER_ENTRY)


# Distinct globals one pickle may name: a checkpoint names a few dozen. Each is listed with its verdict.
MAX_DISTINCT_GLOBALS = 10_000

# Opcodes walked per file (all its pickles and members together): the walker does about 1.5 million a second,
# and a 20,000-tensor data.pkl has 600,000. Past this many (a 60 MB pickle of NONE/POP pairs took 44 s) the rest
# is not walked: a named error.
MAX_PICKLE_OPCODES = 15_000_000

# A torch.distributed.checkpoint folder is walked as one file, every item of it debiting one budget: a chunk's item
# (a torch.save archive of one tensor) costs its walk about 40 opcodes, so a folder of 1,000,000 chunk entries honestly
# needs 40 million. The folder is allowed MAX_PICKLE_OPCODES plus ITEM_OPCODES for each item its metadata names: the
# walk stays linear in what the metadata lists (itself bounded by its own length and memo bound), and a folder of a
# few items is bounded as one file is.
ITEM_OPCODES = 64


def folder_opcodes(items: int) -> int:
    return MAX_PICKLE_OPCODES + ITEM_OPCODES * items

# MARKs open at once (each a list on the walker's stack of stacks, an entry in CPython's): an honest pickle opens
# one per container being built inside another, as deep as its pickler recursed (1,000 by default). 120 million
# MARKs (a 117 KB deflated data.pkl) cost the walk 1.2 GB.
MAX_OPEN_MARKS = 100_000

# Tuples nested in tuples: hashing one (a dict key, a set member) recurses in C once per level, with no recursion
# check, and a 1 MB pickle of TUPLE1s nested a million deep took CPython's stack and the process with it (SIGSEGV).
# CPython's pickler itself cannot write one deeper than its recursion limit (1,000 by default).
MAX_TUPLE_DEPTH = 10_000

# Tuples visited hashing the dict keys and set members of one file, shared parts counted each time they are reached
# (the walk counts them; CPython 3.11 does not cache a tuple's hash). ~0.2 s of hashing; a 120-byte key of three
# references to the level below, 40 levels deep, is 3**40.
MAX_HASHED_TUPLES = 10_000_000

# Dict keys and set members of one hash: CPython inserts n of them in time n**2 (30,000 ints k * (2**61 - 1), which
# all hash to 0, took 23 s; 4,096 take ~0.4 s). Only numbers a file can make collide are counted (ints past 2**61,
# -1 and -2, floats, tuples and frozensets of them): str and bytes hashes are salted per process.
MAX_KEYS_OF_ONE_HASH = 4_096
# ... and the distinct such keys kept to count them, in hash buckets already crowded (honest keys spread out).
MAX_CROWDED_KEYS = 262_144

# Items and tuples the unpickler's set(), frozenset(), OrderedDict() and Counter() hash, all calls of one pickle
# together: a list of 200,000 items handed to set() a million times through the memo is 2 * 10**11. Each item also
# costs the container it goes into (~100 bytes in an OrderedDict): 2 million are ~0.2 s and ~200 MB. An honest
# pickle gives these calls its metadata's sets and a Python 2 OrderedDict's pairs.
MAX_HASH_WORK = 2_000_000

# A single string or byte string the unpickler would build: checkpoints hold tensor bytes outside their pickles,
# and a 700 MB value costs three times its size on the way to a report.
MAX_PICKLE_VALUE = 256 << 20

# Pickles inside bytes inside pickles (a payload handed to pickle.loads) are walked this deep.
MAX_NESTED_DEPTH = 4
# ... and at most this many bytes of nested pickles per file, so a file of many small byte strings stays linear.
MAX_NESTED_BYTES = 64 << 20

# A pickle is walked statically up to this size. The biggest pickles of real checkpoints (20,000-tensor data.pkl)
# are a few MB; a bare pickle with arrays inside can be big, and the walker skips string payloads without copying.
MAX_PICKLE_BYTES = 1 << 30

# A pickle ckpt-doctor unpickles (to list a checkpoint's tensors) is at most this big; a bigger one is walked for
# what it would run, in place, but not unpickled. A 20,000-tensor data.pkl is 2 MB.
MAX_UNPICKLE_BYTES = 256 << 20

# The unpickler may grow the address space by this much while one pickle is read: a last line of defence under
# the walker's checks, so an allocation the checks did not foresee is a MemoryError (exit 2), never an OOM kill.
UNPICKLE_HEADROOM = 768 << 20

# --- the unpickled tree --------------------------------------------------------------------------------------

# Objects visited when a pickled tree is turned into key paths. Shared sub-trees are walked once, so an honest
# tree costs about one visit per object the pickle made — at most one per 2 bytes of pickle.
def max_tree_nodes(pickle_length: int) -> int:
    return 200_000 + pickle_length // 2


# A key path (`layers.3.attn.q_proj.weight`) longer than this is not a key: one long key reused at every level
# of nested dicts would make paths of gigabytes.
MAX_KEY_LENGTH = 16_384
# ... and all tensors' key paths together at most this much: 300,000 keys of 100 characters are 30 MB; 180,000
# keys nested 480 `module.`s deep (a 2 MB file) were 600 MB.
MAX_KEY_BYTES = 96 << 20

# Metadata leaves listed per checkpoint (epoch, lr, args...); the rest are counted, not listed.
MAX_METADATA = 2_000

# Tensors in one checkpoint. The largest published state_dicts hold about 100,000 tensors (a mixture of experts
# with its optimizer states, a few times that); each record costs ~1 KB.
MAX_TENSORS = 300_000

# --- containers ----------------------------------------------------------------------------------------------

# A zip member is inflated only when the directory says it is at most this big...
MAX_INFLATED_MEMBER = 256 << 20
# ... and claims no more than deflate can reach (1032:1); a member claiming more is a bomb, refused unread.
MAX_DEFLATE_RATIO = 1032
# ... and all members of one archive together inflate to at most this much.
MAX_INFLATED_TOTAL = 512 << 20

# Members in one zip archive: a torch.save file has one per storage plus five, and storages are at most tensors
# (MAX_TENSORS). Each listed member costs ~600 bytes: 3 million took 2 GB.
MAX_ZIP_MEMBERS = 400_000
# ... and its central directory at most this many bytes (600,000 members of 210-byte names took 1.3 GB).
MAX_ZIP_DIRECTORY = 48 << 20

# A zip archive smaller than this is read whole to find its local headers in one syscall.
ZIP_WHOLE_READ = 16 << 20

# The safetensors reference parser refuses headers over 100 MB.
MAX_SAFETENSORS_HEADER = 100_000_000

# JSON (safetensors headers, shard indexes) nests at most this deep; serde_json, the reference parser's, stops
# at 128, and Python's json module would raise RecursionError somewhere past 1,000.
MAX_JSON_DEPTH = 128

# A shard index (`*.index.json`) is at most this big.
MAX_INDEX_BYTES = 64 << 20

# Bytes a remote DCP folder's files may cost past the items its metadata names in them (each file counted up to its
# size). An honest folder's files are its items end to end (and a blob of them), so reading never fetches more than
# the items; a metadata naming one object under thousands of names (a server aliasing them) fetched 1.6 GB in 8,752
# requests for one 5.5 MB object, and each name is walked whole by `scan`.
MAX_DCP_UNNAMED_FETCH = 16 << 20

# Files looked at when a folder is scanned.
MAX_FOLDER_FILES = 100_000
