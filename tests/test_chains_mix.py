"""The resume property over drawn pipelines that mix 2-3 drawn components (hypothesis).

Each component is a drawn chain over a drawn source kind (in memory, JSONL, Parquet, Arrow file,
Arrow stream): optional shuffle and shard, then filter, map, prefetch and parallel map (threads).
After the mix (any ``on_end``, either schedule) come drawn nodes among filter, map, prefetch,
parallel map, repeat(2), a packer (greedy, first_fit, best_fit or a windowed bfd, each over a
buffer; a whole-epoch bfd plan cannot follow a mix) and batch.

The property: iterate k items, take the state, send it through JSON, restore into a freshly
built pipeline and continue; the result equals the uninterrupted run. For every k it also
restores the old state into the original pipeline after it moved on, loads the same state
twice in a row into another fresh pipeline, and restores again from a restored pipeline.
Continuations are compared ``for`` loop by ``for`` loop, so a restored pipeline must also end
its epochs where the original did. k runs over 0, the middle of the first epoch, its last
item, the step after it and a drawn point, plus a state taken after a ``for`` loop ran the
first epoch to its end; every run crosses into the next epoch (iterating again, or repeat(2)).
"""

from __future__ import annotations

import json
import warnings
from itertools import islice
from typing import Any, Callable

import numpy as np
from hypothesis import given, reject, settings
from hypothesis import strategies as st

import resumable as rs
from resumable import Node
from tests.resume import flat, loops, plain, roundtrip
from tests.sources import INDEXED_KINDS, indexed_source

Build = Callable[[], Node[Any]]
Step = tuple[Any, ...]

# Items in the longest run a property compares: enough for two epochs of the small components.
CAP = 60
SEQ_LENS = (4, 8, 13)


def documents(component: int, size: int) -> list[dict[str, Any]]:
    """``size`` documents of 0 to 12 tokens (the first has at least one, so a file's column
    has a type); token ``t`` of document ``i`` of component ``c`` is ``c*10**6 + i*100 + t + 1``."""
    lengths = np.random.default_rng(31 * component + size).integers(0, 13, size).tolist()
    lengths[0] = max(1, lengths[0])
    return [
        {"id": 1000 * component + i, "input_ids": [component * 10**6 + i * 100 + t + 1 for t in range(n)]}
        for i, n in enumerate(lengths)
    ]


def tag(item: Any) -> int:
    """An int that depends on the whole item: a document, a packed row or a batch of them."""
    if isinstance(item, list):
        return sum(tag(x) for x in item)
    return int(np.asarray(item["input_ids"], dtype=np.int64).sum()) + int(item.get("id", 0))


def shift(item: dict[str, Any], by: int) -> dict[str, Any]:
    """The item with every token id moved by ``by`` (a document's list, a row's array)."""
    tokens = item["input_ids"]
    moved = tokens + by if isinstance(tokens, np.ndarray) else [int(t) + by for t in tokens]
    return {**item, "input_ids": moved}


def apply_step(pipe: Node[Any], step: Step) -> Node[Any]:
    name = step[0]
    if name == "shuffle":
        return pipe.shuffle(step[1])
    if name == "shard":
        return pipe.shard(step[1], step[2])
    if name == "filter":
        modulus = step[1]
        return pipe.filter(lambda item: tag(item) % modulus != 0)
    if name == "map":
        by = step[1]
        return pipe.map(lambda item: shift(item, by))
    if name == "pmap":
        by = step[1]
        return pipe.map(lambda item: shift(item, by), num_workers=2, mode="thread")
    if name == "prefetch":
        return pipe.prefetch(step[1])
    if name == "repeat":
        return pipe.repeat(2)
    if name == "pack":
        _, strategy, seq_len, buffer_size, overlong = step
        return pipe.pack(seq_len, strategy=strategy, buffer_size=buffer_size, overlong=overlong)
    if name == "batch":
        return pipe.batch(step[1], drop_last=step[2])
    raise ValueError(step)


IndexedSteps = st.tuples(
    st.one_of(st.none(), st.tuples(st.just("shuffle"), st.integers(0, 2**32))),
    st.one_of(
        st.none(),
        st.integers(1, 3).flatmap(lambda world: st.tuples(st.just("shard"), st.integers(0, world - 1), st.just(world))),
    ),
).map(lambda steps: [step for step in steps if step is not None])
ItemStep = st.one_of(
    st.tuples(st.just("filter"), st.integers(2, 5)),
    st.tuples(st.just("map"), st.integers(1, 9)),
    st.tuples(st.just("pmap"), st.integers(1, 9)),
    st.tuples(st.just("prefetch"), st.integers(1, 4)),
)
Component = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(INDEXED_KINDS),
        "size": st.integers(1, 14),
        "steps": st.tuples(IndexedSteps, st.lists(ItemStep, max_size=2)).map(lambda s: [*s[0], *s[1]]),
    }
)
PackStep = st.tuples(
    st.just("pack"),
    st.sampled_from(["greedy", "first_fit", "best_fit", "bfd"]),
    st.sampled_from(SEQ_LENS),
    st.integers(1, 4),
    st.sampled_from(["split", "truncate", "drop"]),
)
Downstream = st.fixed_dictionaries(
    {
        "repeat": st.sampled_from([None, "after_mix", "end"]),
        "before_pack": st.lists(ItemStep, max_size=2),
        "pack": st.one_of(st.none(), PackStep),
        "after_pack": st.lists(ItemStep, max_size=2),
        "batch": st.one_of(st.none(), st.tuples(st.just("batch"), st.integers(1, 3), st.booleans())),
        "prefetch_last": st.booleans(),
    }
)
MixOptions = st.fixed_dictionaries(
    {
        "weights": st.lists(st.integers(0, 3), min_size=3, max_size=3),
        "on_end": st.sampled_from(["stop", "drop", "restart"]),
        "schedule": st.sampled_from(["smooth", "random"]),
        "seed": st.integers(0, 2**16),
    }
)


def downstream_steps(down: dict[str, Any], on_end: str) -> list[Step]:
    if on_end == "restart":
        # A "restart" mix never ends, and its items repeat: a filter after it that happens to
        # reject every item it can ever see (every token sum a multiple of 3, say) would wait
        # forever. Filters inside the components stay (an emptied component is dropped).
        down = {**down, **{part: [s for s in down[part] if s[0] != "filter"] for part in ("before_pack", "after_pack")}}
    steps: list[Step] = [("repeat",)] if down["repeat"] == "after_mix" else []
    steps += down["before_pack"]
    if down["pack"] is not None:
        steps += [down["pack"], *down["after_pack"]]
    if down["repeat"] == "end":
        steps.append(("repeat",))
    if down["batch"] is not None:
        steps.append(down["batch"])
    if down["prefetch_last"]:
        steps.append(("prefetch", 2))
    return steps


def builder(components: list[dict[str, Any]], options: dict[str, Any], steps: list[Step]) -> Build:
    names = [f"c{number}" for number in range(len(components))]
    weights = dict(zip(names, options["weights"]))
    if not any(weights.values()):
        weights[names[0]] = 1

    def build() -> Node[Any]:
        parts = {}
        for number, (name, spec) in enumerate(zip(names, components)):
            part = indexed_source(spec["kind"], documents(number, spec["size"]))
            for step in spec["steps"]:
                part = apply_step(part, step)
            parts[name] = part
        pipe: Node[Any] = rs.mix(
            parts, weights=weights, seed=options["seed"], on_end=options["on_end"], schedule=options["schedule"]
        )
        for step in steps:
            pipe = apply_step(pipe, step)
        return pipe

    return build


def check_resume_everywhere(build: Build, expected: list[Any], k: int, k2: int, drain: bool = False) -> None:
    """The resume property at ``k``, restoring every way a job may; ``expected`` is the
    uninterrupted run, ``k <= k2 <= len(expected)``. With ``drain``, the first ``k`` items are
    the whole first epoch, read by a ``for`` loop to its end (the state says it ended).
    Continuations are compared loop by loop: a restored pipeline ends its epochs where the
    original did (an empty loop first if the state was taken after the last item of an epoch
    but before its end was seen)."""
    total = len(expected)
    with build() as pipe:
        head = plain(list(pipe)) if drain else flat(loops(pipe, k))
        assert len(head) == k
        state = pipe.get_state()
        frozen = json.dumps(state, sort_keys=True)
        saved = roundtrip(state)
        rest = loops(pipe, total - k)
        assert head + flat(rest) == expected, "get_state() disturbed the iteration"
        assert json.dumps(state, sort_keys=True) == frozen, "the state changed after it was taken"
        pipe.set_state(saved)  # the original pipeline, moved on (read-ahead threads too), back to k
        assert loops(pipe, total - k) == rest, "restoring the old state after moving on"

    with build() as resumed:  # the same state again, into a fresh pipeline, loaded twice in a row
        resumed.set_state(saved)
        resumed.set_state(saved)
        assert json.dumps(saved, sort_keys=True) == frozen, "set_state() changed the state it was given"
        middle = flat(loops(resumed, k2 - k))
        assert head + middle == expected[:k2]
        with build() as again:
            again.set_state(roundtrip(resumed.get_state()))
            after = loops(again, total - k2)
            assert head + middle + flat(after) == expected, "restoring a restored pipeline"
            assert loops(resumed, total - k2) == after
        if k2 == k:
            assert after == rest


@settings(max_examples=25, deadline=None)
@given(
    components=st.lists(Component, min_size=2, max_size=3),
    options=MixOptions,
    down=Downstream,
    data=st.data(),
)
def test_chains_with_a_mix_resume_exactly(
    components: list[dict[str, Any]], options: dict[str, Any], down: dict[str, Any], data: st.DataObject
) -> None:
    build = builder(components, options, downstream_steps(down, options["on_end"]))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", rs.BarrenEpochWarning)
            with build() as pipe:
                first_epoch = len(list(islice(pipe, CAP + 1)))
            with build() as pipe:
                expected = flat(loops(pipe, min(2 * first_epoch + 2, CAP)))  # across an epoch boundary
    except rs.BarrenEpochWarning:
        # A packer or filter after a "restart" mix whose chosen components have no token left
        # to pack, or nothing to keep, would read for ever (docs/mixing.md): not a resume property.
        reject()
    total = len(expected)  # fewer where the pipeline is empty
    points = {0, first_epoch // 2, first_epoch, first_epoch + 1, data.draw(st.integers(0, total), label="k")}
    for k in sorted(point for point in points if point <= total):
        check_resume_everywhere(build, expected, k, data.draw(st.integers(k, total), label="k2"))
    if first_epoch <= total:  # a finite first epoch: also saved after the loop over it ended
        check_resume_everywhere(build, expected, first_epoch, total, drain=True)
