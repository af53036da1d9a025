"""Benchmark: the cost of mixing, per item, and of ``get_state()`` / ``set_state()`` on a mix.

Builds ``--components`` in-memory shuffled sources and compares iterating one of them alone
with iterating their mix (both schedules), reports the per-item overhead of the scheduler,
the time of one ``get_state()`` and of a restore at the last item, and how far the realised
proportions are from the weights (largest absolute difference). Then the same for a packer
after a mix of three tokenised components: a ten-node chain whose state holds the packer's
buffered references, each key naming its component.

Usage: python bench/bench_mix.py [--items 200000] [--components 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import resumable as rs  # noqa: E402
from resumable.ops.mix import mix  # noqa: E402


def build(items: int, components: int, schedule: str) -> rs.Node:
    weights = {f"c{i}": float(i + 1) for i in range(components)}
    sources = {name: rs.from_list(list(range(items))).shuffle(i) for i, name in enumerate(weights)}
    return mix(sources, weights=weights, seed=0, schedule=schedule, on_end="restart")


def per_item_us(pipe: rs.Node, items: int) -> float:
    start = time.perf_counter()
    for _, _item in zip(range(items), pipe):
        pass
    return (time.perf_counter() - start) / items * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--components", type=int, default=3)
    args = parser.parse_args()
    items, components = args.items, args.components

    alone = per_item_us(rs.from_list(list(range(items))).shuffle(0), items)
    print(f"one source alone           {alone:8.3f} us/item")
    for schedule in ("smooth", "random"):
        pipe = build(items, components, schedule)
        cost = per_item_us(pipe, items)
        start = time.perf_counter()
        for _ in range(100):
            state = pipe.get_state()
        get_us = (time.perf_counter() - start) / 100 * 1e6
        start = time.perf_counter()
        build(items, components, schedule).set_state(state)
        set_ms = (time.perf_counter() - start) * 1e3
        weights = pipe.weights  # type: ignore[attr-defined]  # the pipeline is a Mix
        total = sum(weights.values())
        shares = pipe.proportions.items()  # type: ignore[attr-defined]  # the pipeline is a Mix
        error = max(abs(share - weights[name] / total) for name, share in shares)
        print(
            f"mix of {components} ({schedule:6})     {cost:8.3f} us/item  (+{cost - alone:.3f})  "
            f"get_state {get_us:7.1f} us  set_state {set_ms:6.2f} ms  max |share - weight| {error:.5f}"
        )

    packed_chain_figures()


def packed_chain_figures(documents: int = 20_000, buffer_size: int = 1000) -> None:
    """``get_state()`` and a restore on mix(3 x source > shuffle > shard > map) > pack > batch."""

    def tokens(index: int) -> dict[str, list[int]]:
        return {"input_ids": list(range(1, 2 + (index * 37) % 900))}

    def chain() -> rs.Node:
        sources = {f"c{i}": rs.from_list(list(range(documents))).shuffle(i).shard(0, 1).map(tokens) for i in range(3)}
        return mix(sources, on_end="restart").pack(2048, buffer_size=buffer_size).batch(8)

    pipe = chain()
    for _ in range(50):
        next(pipe)
    calls = 200
    start = time.perf_counter()
    for _ in range(calls):
        state = pipe.get_state()
    get_us = (time.perf_counter() - start) / calls * 1e6
    start = time.perf_counter()
    chain().set_state(state)
    set_ms = (time.perf_counter() - start) * 1e3
    references = len(state["upstream"]["open"]) + len(state["upstream"]["ready"])
    print(
        f"mix(3) > pack(best_fit, {buffer_size}) > batch, ten nodes: get_state {get_us:7.1f} us, "
        f"{references} references in the state, restore (refetches the buffer) {set_ms:6.1f} ms"
    )


if __name__ == "__main__":
    main()
