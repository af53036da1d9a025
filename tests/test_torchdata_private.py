"""The private parts of torchdata that ``rs.torch.Loader`` relies on, all named in
``resumable/torch/_torchdata.py`` (state keys in ``resumable/loader_state.py``, checked in
``tests/test_loader.py::test_state_key_names_are_torchdata_s``). A torchdata release that
renames or removes one fails here, with the name, instead of deep inside a training job."""

from __future__ import annotations

import inspect

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import resumable as rs
import resumable.torch as rst
from resumable.torch import _torchdata


@pytest.mark.parametrize(
    "cls, name", [(cls, name) for cls, names in _torchdata.PRIVATE_NAMES.items() for name in names]
)
def test_every_private_method_still_exists(cls: type, name: str) -> None:
    assert callable(getattr(cls, name, None)), f"torchdata's {cls.__name__} has no method {name}"


SNAPSHOT_ENTRIES = ("_SNAPSHOT", "_SNAPSHOT_STEP", "_LAST_YIELDED_WORKER_ID", "_MAIN_SNAPSHOT", "_WORKER_SNAPSHOTS")


@pytest.mark.parametrize("workers", [0, 1])
def test_every_private_attribute_still_exists(workers: int) -> None:
    loader = StatefulDataLoader(torch.utils.data.TensorDataset(torch.arange(4)), num_workers=workers)
    iterator = iter(loader)
    try:
        for cls, names in _torchdata.PRIVATE_ATTRIBUTES.items():
            if isinstance(iterator, cls):
                for name in names:
                    assert hasattr(iterator, name), f"torchdata's {cls.__name__} no longer sets {name}"
        if not workers:
            assert isinstance(getattr(iterator, "_NUM_YIELDED", None), str), "torchdata's iterator has no _NUM_YIELDED"
        if workers:
            for name in (*SNAPSHOT_ENTRIES, "_STEPS_SINCE_SNAPSHOT"):
                assert isinstance(getattr(iterator, name, None), str), f"torchdata's iterator has no {name}"
            state = iterator.state_dict()
            assert set(state) == {iterator._SNAPSHOT, iterator._STEPS_SINCE_SNAPSHOT, "_iterator_finished"}
            assert set(state[iterator._SNAPSHOT]) == {getattr(iterator, name) for name in SNAPSHOT_ENTRIES[1:]}
    finally:
        del iterator


def test_the_dataloader_hooks_and_iterator_constructors_keep_their_shape() -> None:
    loader = StatefulDataLoader(torch.utils.data.TensorDataset(torch.arange(4)))
    for name in _torchdata.LOADER_HOOKS:
        assert hasattr(loader, name), f"StatefulDataLoader has no {name}"
    for cls in (_torchdata._SingleProcessIterator, _torchdata._MultiProcessIterator):
        assert list(inspect.signature(cls.__init__).parameters)[:3] == ["self", "loader", "next_iter_state"]


def test_the_loader_uses_them_through_one_module() -> None:
    import resumable.torch.loader as loader_module

    source = inspect.getsource(loader_module)
    assert "torchdata.stateful_dataloader.stateful_dataloader" not in source
    assert "_shutdown_workers" not in source
    # one read of _iterator, inlined in state_dict() (per training step), as _torchdata says
    assert source.count("._iterator") == 1
    assert "self._iterator" in inspect.getsource(loader_module.Loader.state_dict)
    with rst.Loader(lambda: rs.from_list(list(range(6))).batch(2), num_workers=1) as loader:
        assert [[int(x) for x in batch] for batch in loader] == [[0, 1], [2, 3], [4, 5]]


def test_the_main_snapshot_is_torchdata_s() -> None:
    """``_MultiProcessIterator._get_main_state`` answers the ``Stateful`` question once per
    class; what it returns must stay exactly torchdata's, for a plain and a stateful sampler."""

    class CountingSampler(torch.utils.data.Sampler[int]):
        def __init__(self) -> None:
            self.served = 3

        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(range(4))

        def __len__(self) -> int:
            return 4

        def state_dict(self) -> dict[str, int]:
            return {"served": self.served}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.served = state["served"]

    for sampler in (None, CountingSampler()):
        loader = StatefulDataLoader(
            torch.utils.data.TensorDataset(torch.arange(4)), num_workers=1, sampler=sampler, batch_size=None
        )
        iterator = _torchdata.new_iterator(loader, None)
        try:
            next(iterator)
            ours = iterator._get_main_state()
            assert ours == super(_torchdata._MultiProcessIterator, iterator)._get_main_state()
            assert (ours["_index_sampler_state"] is not None) == (sampler is not None)
        finally:
            iterator._shutdown_workers()


class StatefulIterable(torch.utils.data.IterableDataset):  # type: ignore[type-arg]  # a plain test dataset
    """A dataset whose iterator is ``Stateful`` and not the dataset itself (as a
    ``PipelineDataset``'s), and which is ``Stateful`` too."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        return StatefulIterator()

    def state_dict(self) -> dict[str, int]:
        return {"dataset": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Nothing to load."""


class StatefulIterator:
    def __init__(self) -> None:
        self.served = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        return self

    def __next__(self) -> int:
        self.served += 1
        if self.served > 5:
            raise StopIteration
        return self.served

    def state_dict(self) -> dict[str, int]:
        return {"served": self.served}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.served = state["served"]


@pytest.mark.parametrize(
    "dataset",
    [StatefulIterable(), rst.PipelineDataset(lambda: rs.from_list([1, 2, 3])), "map"],
    ids=["stateful-iterable", "pipeline", "map"],
)
def test_the_single_process_state_is_torchdata_s(dataset: object) -> None:
    """Without workers the iterator's ``state_dict()`` asks the ``Stateful`` question once per
    class; its entries must stay torchdata's, for an iterable dataset (stateful or not, its
    iterator itself or not) and a map-style one, before, during and after a pass."""
    if dataset == "map":
        dataset = torch.utils.data.TensorDataset(torch.arange(4))
    loader = StatefulDataLoader(dataset, batch_size=None)
    iterator = _torchdata.new_iterator(loader, None)
    torchdata_s = super(_torchdata._SingleProcessIterator, iterator).state_dict
    assert iterator.state_dict() == torchdata_s()
    for _ in iterator:
        assert iterator.state_dict() == torchdata_s()
    assert iterator.state_dict() == torchdata_s() and iterator.state_dict()["_iterator_finished"]
