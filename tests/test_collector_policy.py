"""The cycle collector kept off what outlives a graph pass (recipes/process/collector_policy.py): what was alive before is
frozen for the pass, a cycle that was garbage already is freed on entry, cycles made inside are still collected,
and only the outermost pass unfreezes."""
import gc
import weakref

from recipes.process.collector_policy import collector_skipping_older_objects


class Node:
    def __init__(self):
        self.other = self


def _garbage_cycle() -> weakref.ref:
    return weakref.ref(Node())


def test_a_pass_freezes_what_lives_and_frees_what_is_already_garbage():
    alive = Node()
    before = _garbage_cycle()
    assert before() is not None  # a cycle: only the collector frees it
    with collector_skipping_older_objects():
        assert before() is None
        assert gc.get_freeze_count() > 0 and not any(alive is o for o in gc.get_objects())  # skipped by collections
        inside = _garbage_cycle()
        gc.collect()
        assert inside() is None
    assert gc.get_freeze_count() == 0 and any(alive is o for o in gc.get_objects())


def test_only_the_outermost_pass_unfreezes():
    with collector_skipping_older_objects():
        with collector_skipping_older_objects():
            pass
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
