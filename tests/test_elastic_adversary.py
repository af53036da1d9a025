"""Elastic restore of streaming packers, attacked: drawn chains (every strategy with a buffer,
every overlong policy, a batch, prefetch or repeat above the packer, a repeat below it), drawn
topologies (shrinking, growing, to one consumer), old states given as JSON text in every
spelling a checkpoint may hold (orjson, compact or spaced ``json.dumps``, sorted keys, ASCII
escapes) and rescaled a rank at a time; mix component names that spell a packer's header and
``"upstream":`` inside strings; an old text truncated or damaged at every offset. Every token is
delivered exactly once, a text rescales as its dict does, and damage is a ``StateError`` that
leaves the pipeline as it was."""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any, Callable

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

import resumable as rs
from resumable.elastic import rescaled_states, restore
from resumable.pack._rescale import buffer_free_text
from tests.test_elastic import SEQ_LEN, delivered, documents, keep, take_fraction

Build = Callable[[int, int], rs.Node]
Spell = Callable[[dict[str, Any]], Any]

SPELLINGS: dict[str, Spell] = {
    "dict": lambda state: state,
    "orjson": lambda state: orjson.dumps(state).decode(),
    "compact": lambda state: json.dumps(state, separators=(",", ":")),
    "compact_unicode": lambda state: json.dumps(state, separators=(",", ":"), ensure_ascii=False),
    "spaced": json.dumps,
    "sorted": lambda state: orjson.dumps(state, option=orjson.OPT_SORT_KEYS).decode(),
    "indented": lambda state: json.dumps(state, indent=1),
}
STRATEGIES = ("greedy", "first_fit", "best_fit", "bfd")
ABOVE = ("none", "batch", "prefetch", "repeat")
# Mix component names that spell, inside strings and keys, what buffer_free_text looks for.
TRICKY_NAMES = ('w"upstream":{"kind":"Pack","version":1,', "ü,\u2028\\upstream")


def packed_chain(strategy: str, overlong: str, buffer_size: int, above: str, repeat: bool, filtered: bool) -> Build:
    def build(consumer: int, consumers: int) -> rs.Node:
        node: rs.Node = rs.from_list(documents(70)).shuffle(5).shard(consumer, consumers)
        if repeat:
            node = node.repeat(2)
        if filtered:
            node = node.filter(keep)
        node = node.pack(SEQ_LEN, strategy=strategy, buffer_size=buffer_size, overlong=overlong)
        if above == "batch":
            return node.batch(2)
        if above == "prefetch":
            return node.prefetch(2)
        return node.repeat(2) if above == "repeat" else node

    return build


def tokens_of(overlong: str, repeat: bool, filtered: bool) -> Counter[int]:
    docs = [d for d in documents(70) if keep(d) or not filtered]
    if overlong == "drop":
        docs = [d for d in docs if len(d["input_ids"]) <= SEQ_LEN]
    limit = SEQ_LEN if overlong == "truncate" else None
    once = Counter(t for d in docs for t in d["input_ids"][:limit])
    return once + once if repeat else once


def run(build: Build, phases: list[tuple[int, list[float], int]], spell: Spell) -> Counter[int]:
    """Each phase: ``C`` consumers each take a fraction of what they hold, then all save; the
    next phase's consumers are rescaled ``rank`` at a time (``rescaled_states`` over groups of
    consecutive consumers) from the states spelled by ``spell``. The last phase reads to the end
    (of both passes, with a repeat above the packer: the phases then straddle its boundary)."""
    seen: Counter[int] = Counter()
    olds: list[Any] | None = None
    for number, (consumers, fractions, rank_size) in enumerate(phases):
        pipes = [build(consumer, consumers) for consumer in range(consumers)]
        if olds is not None:
            for first in range(0, consumers, rank_size):
                group = pipes[first : first + rank_size]
                for pipe, state in zip(group, rescaled_states(group, olds)):
                    pipe.set_state(state)
        states = []
        for consumer, pipe in enumerate(pipes):
            if number == len(phases) - 1:
                items = list(pipe)
            else:
                items = take_fraction(pipe, fractions[consumer % len(fractions)])
            for item in items:
                seen.update(delivered("pack", item))
            states.append(spell(json.loads(json.dumps(pipe.get_state()))))
            pipe.close()
        olds = states
    return seen


PHASES = st.lists(
    st.tuples(st.integers(1, 6), st.lists(st.floats(0, 1), min_size=1, max_size=3), st.integers(1, 4)),
    min_size=2,
    max_size=3,
)


@given(
    strategy=st.sampled_from(STRATEGIES),
    overlong=st.sampled_from(("split", "truncate", "drop")),
    buffer_size=st.integers(1, 6),
    above=st.sampled_from(ABOVE),
    repeat=st.booleans(),
    filtered=st.booleans(),
    spelling=st.sampled_from(sorted(SPELLINGS)),
    phases=PHASES,
)
def test_every_token_once_for_drawn_chains_topologies_and_spellings(
    strategy: str,
    overlong: str,
    buffer_size: int,
    above: str,
    repeat: bool,
    filtered: bool,
    spelling: str,
    phases: list[tuple[int, list[float], int]],
) -> None:
    if strategy == "bfd" and overlong == "split":
        overlong = "truncate"  # bfd never splits a document
    if above == "repeat" and repeat:
        repeat = False  # one repeat per pipeline
    build = packed_chain(strategy, overlong, buffer_size, above, repeat, filtered)
    expected = tokens_of(overlong, repeat or above == "repeat", filtered)
    assert run(build, phases, SPELLINGS[spelling]) == expected


@pytest.mark.parametrize("new", [1, 2, 3, 9])
@pytest.mark.parametrize("above", ABOVE)
def test_texts_in_every_spelling_rescale_as_their_dicts(above: str, new: int) -> None:
    build = packed_chain("best_fit", "split", 4, above, False, True)
    olds = []
    for consumer in range(5):
        pipe = build(consumer, 5)
        take_fraction(pipe, 0.15 * consumer + 0.1)
        olds.append(json.loads(json.dumps(pipe.get_state())))
    expected = rescaled_states([build(c, new) for c in range(new)], olds)
    for name, spell in SPELLINGS.items():
        texts = [spell(state) for state in olds]
        for rank in range(new):  # one rank of one worker each: most old buffers are not inherited
            assert rescaled_states([build(rank, new)], texts) == [expected[rank]], name


def mixed(names: tuple[str, str], packed_components: bool) -> Build:
    """A mix of two components named ``names``, packed after the mix (the component names then
    fill the packer's ``origins``) or inside each component (two packers), then batched."""

    def build(consumer: int, consumers: int) -> rs.Node:
        first = rs.from_list(documents(40)).shuffle(1).shard(consumer, consumers)
        second = rs.from_list(shifted(documents(30))).shuffle(2).shard(consumer, consumers)
        if packed_components:
            first = first.pack(SEQ_LEN, buffer_size=3)
            second = second.pack(SEQ_LEN, strategy="first_fit", buffer_size=2)
        node = rs.mix({names[0]: first, names[1]: second}, seed=4, on_end="drop")
        return (node if packed_components else node.pack(SEQ_LEN, buffer_size=4)).batch(2)

    return build


def shifted(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"input_ids": [t + 10**7 for t in d["input_ids"]]} for d in docs]


@pytest.mark.parametrize("packed_components", [False, True])
@pytest.mark.parametrize("spelling", ["orjson", "compact", "spaced"])
def test_component_names_that_spell_a_packers_header_inside_strings(packed_components: bool, spelling: str) -> None:
    build = mixed(TRICKY_NAMES, packed_components)
    every = Counter(t for d in documents(40) + shifted(documents(30)) for t in d["input_ids"])
    assert run(build, [(4, [0.3, 0.6, 0.1], 4), (3, [0.5], 1), (2, [1.0], 2)], SPELLINGS[spelling]) == every


def cut_equivalent(state: dict[str, Any], depth: int) -> dict[str, Any]:
    """``state`` with the packer ``depth`` upstreams down reduced to kind, version and what follows
    its own entries (its upstream): what a rescale that does not inherit its buffer reads."""
    copied = json.loads(json.dumps(state))
    node = copied
    for _ in range(depth):
        node = node["upstream"]
    for key in [key for key in node if key not in ("kind", "version", "upstream")]:
        del node[key]
    return copied


@pytest.mark.parametrize("above", ["none", "batch", "prefetch", "repeat"])
def test_a_cut_text_parses_to_the_state_less_only_the_packers_own_entries(above: str) -> None:
    build = packed_chain("best_fit", "split", 4, above, False, True)
    depth = 0 if above == "none" else 1
    pipe = build(1, 3)
    for fraction in (0.0, 0.2, 0.5, 1.0):
        take_fraction(pipe, fraction)
        state = json.loads(json.dumps(pipe.get_state()))
        cut = buffer_free_text(orjson.dumps(state).decode(), depth)
        assert cut is not None
        assert orjson.loads(cut) == cut_equivalent(state, depth)
        assert buffer_free_text(orjson.dumps(state).decode(), depth + 1) is None  # no packer there
        for spell in ("spaced", "sorted", "indented"):
            text = SPELLINGS[spell](state)
            assert buffer_free_text(text, depth) is None, spell


def states_and_texts(build: Build, consumers: int) -> list[str]:
    texts = []
    for consumer in range(consumers):
        pipe = build(consumer, consumers)
        take_fraction(pipe, 0.2 + 0.2 * consumer)
        texts.append(orjson.dumps(pipe.get_state()).decode())
    return texts


BATCHED = packed_chain("best_fit", "split", 3, "batch", False, False)
OLD_TEXTS = states_and_texts(BATCHED, 3)


def rescale_damaged(text: str, target: int, new: int, iterate: bool = True) -> bool:
    """Restore new consumer ``new`` of 2 from the old texts with ``target``'s replaced by
    ``text``: it succeeds (True), or raises StateError and leaves the pipeline as it was (its
    state, and with ``iterate`` what it then yields)."""
    olds = list(OLD_TEXTS)
    olds[target] = text
    pipe = BATCHED(new, 2)
    before = json.dumps(pipe.get_state())
    try:
        restore(pipe, olds)
    except rs.StateError:
        assert json.dumps(pipe.get_state()) == before
        fresh = [delivered("pack", batch) for batch in BATCHED(new, 2)] if iterate else None
        assert not iterate or [delivered("pack", batch) for batch in pipe] == fresh
        return False
    return True


@pytest.mark.parametrize("new", [0, 1])  # inherits old consumers 0-1 / 2 (i * 2 // 3 == new)
def test_a_text_truncated_at_every_offset_is_a_state_error(new: int) -> None:
    text = OLD_TEXTS[1]
    taken = [end for end in range(len(text)) if rescale_damaged(text[:end], 1, new, iterate=False)]
    assert not taken, f"texts truncated at {taken} of {len(text)} were taken"


DAMAGE = '0 9"{}[],:x\\-'


@given(target=st.integers(0, 2), new=st.integers(0, 1), at=st.integers(0, 10**6), char=st.sampled_from(DAMAGE))
def test_a_text_damaged_at_any_offset_restores_or_is_a_state_error(target: int, new: int, at: int, char: str) -> None:
    text = OLD_TEXTS[target]
    at %= len(text)
    rescale_damaged(text[:at] + char + text[at + 1 :], target, new)


@pytest.mark.parametrize("bad", ['"\\ud800"', "1e400", str(2**64), str(2**63), "NaN", "[" * 2000, "-0", "true", "1.0"])
@pytest.mark.parametrize("key", ["position", "count", "seq_len", "rank", "version", "batch_size"])
def test_odd_json_values_in_a_text_restore_or_are_state_errors(key: str, bad: str) -> None:
    text = OLD_TEXTS[1]
    at = text.index(f'"{key}":') + len(key) + 3
    end = at + len(re.match(r"-?\d+", text[at:]).group())  # type: ignore[union-attr]  # every key holds an int
    for new in (0, 1):
        rescale_damaged(text[:at] + bad + text[end:], 1, new)
