"""The scan that builds a line index: a JSONL file's bytes, chunk by chunk, into record starts.

A record is a non-blank line. Newlines are found with numpy at disk speed; the few lines that
may be blank (their first byte is blank) are told apart by vectorised steps over their bytes.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

BLANK_STEPS = 16
"""Leading bytes of possibly-blank lines checked by vectorised steps (one byte column per step);
only a line starting with more blank bytes than that is finished on its own (practically never)."""

NEWLINE = 0x0A
UTF8_BOM = b"\xef\xbb\xbf"
BLANK_BYTES = b" \t\r"
"""Bytes a blank line may hold: JSON whitespace, less the newline that ends the line."""
_IS_BLANK_BYTE = np.zeros(256, dtype=np.bool_)
_IS_BLANK_BYTE[list(BLANK_BYTES)] = True
_MAY_START_BLANK = _IS_BLANK_BYTE.copy()
_MAY_START_BLANK[NEWLINE] = True  # an empty line's first byte is its newline


class Scanner:
    """Turns consecutive chunks of a file into record starts, carrying the unfinished line over."""

    def __init__(self, first_byte: int) -> None:
        self.line_start = first_byte  # absolute offset of the line not yet ended by a newline
        self.line_blank = True  # whether every byte of that line seen so far is blank
        self.blank_lines = 0
        self._parts: list[npt.NDArray[np.int64]] = []

    def feed(self, chunk: npt.NDArray[np.uint8], is_newline: npt.NDArray[np.bool_], offset: int) -> None:
        """Scan ``chunk``, the file's bytes at ``offset``; ``is_newline`` is scratch space as long."""
        mask = is_newline[: chunk.size]
        np.equal(chunk, NEWLINE, out=mask)
        newlines = np.flatnonzero(mask)
        if newlines.size == 0:
            self.line_blank = self.line_blank and _all_blank(chunk)
            return
        carried_is_record = not (self.line_blank and _all_blank(chunk[: newlines[0]]))
        starts = newlines[:-1] + 1  # lines that begin and end in this chunk
        blank = _blank_lines(chunk, starts, newlines[1:])
        records = np.delete(starts, blank) if blank.size else starts
        records += offset
        if carried_is_record:
            records = np.concatenate(([self.line_start], records))
        self._parts.append(records)
        self.blank_lines += blank.size + (not carried_is_record)
        tail = int(newlines[-1]) + 1
        self.line_start = offset + tail
        self.line_blank = _all_blank(chunk[tail:])

    def finish(self, size: int) -> npt.NDArray[np.uint64]:
        """The ``starts`` array, once the whole file (``size`` bytes) has been fed."""
        if self.line_start < size:  # a last line without a newline
            if self.line_blank:
                self.blank_lines += 1
            else:
                self._parts.append(np.array([self.line_start], dtype=np.int64))
        self._parts.append(np.array([size], dtype=np.int64))
        return np.concatenate(self._parts).view(np.uint64)  # offsets are never negative


def _all_blank(line: npt.NDArray[np.uint8]) -> bool:
    """Whether every byte is a blank byte; looks at the first byte alone in the common case."""
    return line.size == 0 or (bool(_IS_BLANK_BYTE[line[0]]) and bool(_IS_BLANK_BYTE[line].all()))


def _blank_lines(
    chunk: npt.NDArray[np.uint8], starts: npt.NDArray[np.int64], ends: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """Indices of the blank lines among those at ``starts`` (each ended by the newline at ``ends``).

    Only lines whose first byte is blank or the newline can be blank; of those, the ones shorter
    than two bytes are. The rest are followed one byte column per vectorised step until they reach
    their newline (blank) or a non-blank byte (a record); the rare lines still undecided after
    ``BLANK_STEPS`` bytes are finished one by one.
    """
    live = np.flatnonzero(_MAY_START_BLANK[chunk[starts]])
    if live.size == 0:
        return live
    position = starts[live]
    short = ends[live] - position < 2
    found = [live[short]]
    live, position = live[~short], position[~short] + 1
    for _ in range(BLANK_STEPS):
        if live.size == 0:
            return np.concatenate(found)
        byte = chunk[position]
        found.append(live[byte == NEWLINE])
        going = _IS_BLANK_BYTE[byte]
        live, position = live[going], position[going] + 1
    undecided = zip(live.tolist(), position.tolist(), ends[live].tolist(), strict=True)
    found.append(np.array([line for line, begin, end in undecided if _all_blank(chunk[begin:end])], dtype=np.int64))
    return np.concatenate(found)
