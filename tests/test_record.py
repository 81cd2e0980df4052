"""The result types' decorator behaves as dataclasses does for everything ckpt-doctor uses: checked against a real
frozen dataclass of the same fields."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from ckpt_doctor._record import FrozenInstanceError, field, record, replace


@record
class Rec:
    a: int
    b: str = "x"
    c: dict = field(default_factory=dict, compare=False)
    d: tuple = field(default=(), repr=False)


@dataclasses.dataclass(frozen=True)
class Ref:
    a: int
    b: str = "x"
    c: dict = dataclasses.field(default_factory=dict, compare=False)
    d: tuple = dataclasses.field(default=(), repr=False)


@record(frozen=False)
class Mutable:
    items: list = field(default_factory=list)


@pytest.mark.parametrize("args, kwargs", [((1,), {}), ((1, "y"), {}), ((), {"a": 2, "d": (1,)}), ((3,), {"c": {}})])
def test_construction_repr_and_equality_match_dataclasses(args, kwargs):
    mine, ref = Rec(*args, **kwargs), Ref(*args, **kwargs)
    assert repr(mine).replace("Rec(", "Ref(") == repr(ref)
    assert (mine == Rec(*args, **kwargs)) is True and (mine == ref) is False  # another class is never equal
    assert hash(mine) == hash(Rec(*args, **kwargs))
    assert Rec(1, c={"k": 1}) == Rec(1, c={"k": 2})  # compare=False: left out of == and hash, as in dataclasses
    assert Rec(1) != Rec(2) and Rec(1, d=(1,)) != Rec(1)


def test_the_same_errors_as_dataclasses():
    for make in (Rec, Ref):
        with pytest.raises(TypeError, match="missing"):
            make()
        with pytest.raises(TypeError, match="unexpected keyword"):
            make(1, z=2)
        with pytest.raises(TypeError, match="multiple values|takes"):
            make(1, a=1)
        with pytest.raises(dataclasses.FrozenInstanceError if make is Ref else FrozenInstanceError):
            make(1).a = 2
        with pytest.raises(AttributeError):
            del make(1).b
    with pytest.raises(TypeError, match="non-default argument"):
        record(type("Bad", (), {"__annotations__": {"a": "int", "b": "int"}, "a": 1}))


def test_defaults_are_not_shared_and_replace_checks_names():
    one, two = Rec(1), Rec(2)
    assert one.c is not two.c
    changed = replace(one, b="z")
    assert (changed.a, changed.b, one.b) == (1, "z", "x") and isinstance(changed, Rec)
    with pytest.raises(TypeError, match="unexpected keyword"):
        replace(one, nope=1)
    assert replace(Ref(1), b="q") == Ref(1, "q")  # real dataclasses go through dataclasses.replace


def test_mutable_records_are_unhashable_and_pickle_round_trips():
    m = Mutable()
    m.items.append(1)
    m.items = [2]
    assert m.items == [2] and Mutable() == Mutable() and Mutable() is not Mutable()
    with pytest.raises(TypeError):
        hash(m)
    assert pickle.loads(pickle.dumps(Rec(5, "p", {"k": 1}, (2,)))) == Rec(5, "p", {}, (2,))


@record(slots=True)
class Slotted:
    a: int
    b: str = "x"
    c: dict = field(default_factory=dict, compare=False)
    d: tuple = field(default=(), repr=False)


@pytest.mark.parametrize("args, kwargs", [((1,), {}), ((1, "y"), {}), ((), {"a": 2, "d": (1,)}), ((3,), {"c": {}})])
def test_slotted_records_behave_as_the_others_without_a_dict(args, kwargs):
    """record(slots=True) (a Piece: a million of them for a DCP folder of a million chunks) behaves as a record."""
    from ckpt_doctor._record import asdict, fast_new

    mine, ref = Slotted(*args, **kwargs), Rec(*args, **kwargs)
    assert not hasattr(mine, "__dict__")
    assert repr(mine).replace("Slotted(", "Rec(") == repr(ref)
    assert mine == Slotted(*args, **kwargs) and hash(mine) == hash(Slotted(*args, **kwargs)) and mine != ref
    assert asdict(mine) == asdict(ref)
    assert pickle.loads(pickle.dumps(mine)) == mine
    assert replace(mine, b="z") == Slotted(mine.a, "z", d=mine.d) and mine.b == ref.b
    assert fast_new(Slotted, a=mine.a, b=mine.b, c={}, d=mine.d) == mine
    with pytest.raises(FrozenInstanceError):
        mine.a = 2
    with pytest.raises(AttributeError):
        del mine.b
    with pytest.raises(TypeError, match="missing"):
        Slotted()
