"""The weight version an engine is given after an update that failed part-way (`transfer.versions`): it says what
the engine holds, never more."""
import pytest

from reshard_cli.transfer.versions import Held, held_by, label


def test_labels_say_what_every_worker_holds():
    assert label("step-3", Held(7, 7, 7)) == "step-3"
    assert label("step-3", Held(0, 0, 7)) is None  # nothing new: the engine keeps its label
    assert label("step-3", Held(2, 2, 7)) == "step-3+partial-2of7"
    assert label("step-3", Held(2, 3, 7)) == "step-3+mixed-2to3of7"
    assert label(None, Held(1, 1, 2)) == "update+partial-1of2"
    assert label("step-3", Held(0, 0, 0)) is None  # failed before it had groups: nothing committed
    assert Held(2, 3, 7).mixed and Held(2, 3, 7).partial and not Held(7, 7, 7).partial
    assert Held(0, 1, 7).partial and not Held(0, 0, 7).partial
    with pytest.raises(ValueError):
        Held(3, 2, 7)


def test_an_engines_range_from_its_workers_records():
    held = {4: 3, 5: 2}
    assert held_by([4, 5], held, set(), 7) == Held(2, 3, 7)  # workers differ: mixed
    assert held_by([4, 5], {4: 2, 5: 2}, {5}, 7) == Held(2, 3, 7)  # a commit torn part-way on worker 5
    assert held_by([4, 5], {4: 2, 5: 2}, set(), 7) == Held(2, 2, 7)
    assert held_by([4, 5], {}, set(), 7) == Held(0, 0, 7)  # recorded nothing: committed nothing
    # an engine that did not answer may have committed up to the last group whose agreement passed
    assert held_by([4, 5], {4: 2, 5: 2}, set(), 7, upto=3) == Held(2, 3, 7)
    assert held_by([4, 5], {4: 7, 5: 7}, {4}, 7) == Held(7, 7, 7)  # capped at the update's groups
