"""Shuffle: a global permutation of the upstream's positions, new every epoch."""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np

from resumable.core.indexed import IndexedNode
from resumable.core.options import seed_option
from resumable.order.lcg import ROUNDS_OPTION, Permutation, PermutationRounds

T = TypeVar("T")

SEED = "seed"


class Shuffle(PermutationRounds, IndexedNode[T]):
    """Position ``k`` of epoch ``e`` reads upstream position ``perm_{seed,e}(k)``.

    The permutation is a keyed bijection computed by arithmetic: O(1) memory and O(1) random
    access, so the state is just the cursor and a resume costs nothing extra.
    """

    kind = "Shuffle"

    def __init__(self, upstream: IndexedNode[T], seed: int = 0) -> None:
        super().__init__(upstream)
        self.seed = seed_option(self.kind, SEED, seed)
        self._permutation: tuple[tuple[int, int, int], Permutation] | None = None

    def __len__(self) -> int:
        return len(self._parent)

    def permutation(self, epoch: int) -> Permutation:
        """The permutation of ``epoch`` (cached for the last epoch asked for); its size is the
        epoch's, which after a rescale of a shard below is that consumer's new stride."""
        total = self._length(epoch)
        key, cached = (epoch, total, self.rounds), self._permutation
        if cached is None or cached[0] != key:
            cached = self._permutation = (key, Permutation(total, self.seed, epoch, self.rounds))
        return cached[1]

    def _leaf_indices(self, positions: np.ndarray, epoch: int) -> np.ndarray:
        permuted = self.permutation(epoch).take(positions)
        return self._parent._leaf_indices(permuted, epoch)

    def _config(self) -> dict[str, Any]:
        return {SEED: self.seed, ROUNDS_OPTION: self.rounds}
