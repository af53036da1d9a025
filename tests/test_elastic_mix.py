"""Elastic resume of mix -> pack in one process: two rescales within one epoch over 1 to 4
consumers. Every token of every document of every component is delivered exactly once.

Extends ``tests/test_elastic.py::test_mix_then_pack_rescales_every_token_once`` (drawn
topologies, one pipeline) with fixed sequences that always rescale twice, every source kind,
every streaming packer, and read-ahead (prefetch, parallel map) inside the components and
after the mix.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Callable

import pytest

import resumable as rs
from resumable.elastic import restore
from tests.sources import INDEXED_KINDS, indexed_source
from tests.test_elastic import SEQ_LEN, delivered, documents, keep, run_topologies, shifted, take_fraction

Build = Callable[[int, int], rs.Node]
Phases = list[tuple[int, list[float]]]

# (consumers, fraction of what is left that each consumer takes): two rescales in one epoch;
# the last phase reads to the end of the epoch.
TWO_RESCALES: list[Phases] = [
    [(2, [0.3, 0.6]), (4, [0.2, 0.5, 0.1, 0.4]), (3, [1.0])],
    [(4, [0.1, 0.45, 0.25, 0.6]), (1, [0.5]), (2, [1.0])],
    [(1, [0.35]), (3, [0.3, 0.0, 0.6]), (4, [1.0])],
    [(3, [0.5, 0.2, 0.9]), (2, [0.4, 0.7]), (1, [1.0])],
]
WEB, CODE = 60, 40  # documents per component


def mix_then_pack(kind: str, strategy: str = "best_fit", read_ahead: bool = False) -> Build:
    """Two sharded components over ``kind`` files (the second's tokens offset so every token
    names itself), mixed (``on_end="drop"``: the mix reads every component to its end), then
    packed over a buffer. With ``read_ahead``, a prefetch and a parallel map inside the
    components and after the mix."""

    def build(consumer: int, consumers: int) -> rs.Node:
        web = indexed_source(kind, documents(WEB)).shuffle(7).shard(consumer, consumers).filter(keep)
        code = indexed_source(kind, shifted(documents(CODE))).shuffle(2).shard(consumer, consumers)
        if read_ahead:
            web = web.prefetch(3)
            code = code.map(dict, num_workers=2)
        mixed: rs.Node = rs.mix({"web": web, "code": code}, weights={"web": 2, "code": 1}, seed=3, on_end="drop")
        if read_ahead:
            mixed = mixed.map(dict, num_workers=2).prefetch(2)
        buffer_size = None if strategy == "greedy" else 4
        return mixed.pack(SEQ_LEN, strategy=strategy, buffer_size=buffer_size)

    return build


def every_token() -> Counter[int]:
    web = Counter(t for d in documents(WEB) if keep(d) for t in d["input_ids"])
    return web + Counter(t for d in shifted(documents(CODE)) for t in d["input_ids"])


def run_phases(build: Build, phases: Phases) -> Counter[int]:
    """The tokens the packed rows deliver over the topologies of ``phases``."""
    return run_topologies(build, phases, lambda row: delivered("pack", row))


@pytest.mark.parametrize("kind", INDEXED_KINDS)
@pytest.mark.parametrize("phases", TWO_RESCALES, ids=lambda p: "-".join(str(c) for c, _ in p))
def test_mix_then_best_fit_rescaled_twice_delivers_every_token_once(phases: Phases, kind: str) -> None:
    seen = run_phases(mix_then_pack(kind), phases)
    assert sum(seen.values()) == sum(every_token().values())
    assert seen == every_token()


@pytest.mark.parametrize("read_ahead", [False, True])
@pytest.mark.parametrize("strategy", ["best_fit", "first_fit", "greedy", "bfd"])
def test_every_streaming_packer_after_a_mix_rescaled_twice(strategy: str, read_ahead: bool) -> None:
    build = mix_then_pack("jsonl", strategy, read_ahead)
    for phases in TWO_RESCALES[:2]:
        assert run_phases(build, phases) == every_token()


def test_a_rescaled_mix_pack_continues_bit_exactly_on_the_same_topology() -> None:
    """After two rescales, a checkpoint of the third topology restored on that same topology
    (``restore`` takes the exact path) continues with the very same rows."""
    build = mix_then_pack("parquet", read_ahead=True)
    states: list[dict[str, Any]] | None = None
    for consumers, fraction in ((2, 0.3), (4, 0.3), (3, 0.4)):
        new_states = []
        for consumer in range(consumers):
            with build(consumer, consumers) as pipe:
                if states is not None:
                    restore(pipe, states)
                take_fraction(pipe, fraction)
                new_states.append(json.loads(json.dumps(pipe.get_state())))
        states = new_states
    assert states is not None
    for consumer in range(3):
        with build(consumer, 3) as original, build(consumer, 3) as resumed:
            original.set_state(states[consumer])
            restore(resumed, states)
            assert [delivered("pack", row) for row in resumed] == [delivered("pack", row) for row in original]
