"""The entries of a packer's state, and the counters it keeps per epoch."""

# Options that shape the rows (``Pack._config``): a state saved with other values is rejected.
SEQ_LEN = "seq_len"
STRATEGY = "strategy"
BUFFER_SIZE = "buffer_size"
OVERLONG = "overlong"
SPLIT_POSITIONS = "split_positions"
MASK_FIRST_TOKEN = "mask_first_token"
MAX_DOCUMENTS = "max_documents"
INPUT_FIELD = "input_field"
LABELS_FIELD = "labels_field"
PAD_TOKEN_ID = "pad_token_id"
# Payload options, saved only when set (states of packers without them keep their old form).
TOKEN_FIELDS = "token_fields"
DOCUMENT_FIELDS = "document_fields"
LENGTH_FN = "length_fn"
PAYLOAD_OPTIONS = (TOKEN_FIELDS, DOCUMENT_FIELDS, LENGTH_FN)

# Progress of a streaming packer: piece references, flat, and how many of them form each group.
OPEN = "open"
OPEN_SIZES = "open_sizes"
READY = "ready"
READY_SIZES = "ready_sizes"
SPAN = "span"
EXHAUSTED = "exhausted"
# With a ``length_fn``: the positions each piece's document reserves beyond its tokens, one per
# reference in the order open, ready, span, inherited, so a restore plans without the records.
RESERVED = "reserved"
# Since the compact form: every reference above (open, ready, span, inherited, in that order)
# as one encoding of bit-packed ints (``_refs``), and how many belong to each of the four.
REFS = "refs"
SECTIONS = "sections"
# Since the events form: a state taken a few rows after an earlier one saves that earlier
# progress (``BASE_PROGRESS``, in the compact form) and what happened since (``EVENTS``: rows handed
# out, documents taken, a flush, as flat ints), which a restore replays by planning alone.
# ``EVENT_ORIGINS`` lists the key prefixes the documents' origin indices name.
BASE_PROGRESS = "base_progress"
EVENTS = "events_since"
EVENT_ORIGINS = "event_origins"
# Pieces handed over by other consumers in an elastic rescale, packed before the upstream's.
INHERITED = "inherited"
# Progress of a whole-epoch plan (``strategy="bfd"`` without ``buffer_size``); the epoch is the
# indexed upstream's, saved in its state. Rows handed out this epoch (inherited ones first), the
# plan's rows once it is made, and after a rescale the inherited rows: whole rows of old
# consumers' plans, as piece references under INHERITED cut into rows by INHERITED_SIZES.
EMITTED = "emitted"
PLANNED = "planned"
INHERITED_SIZES = "inherited_sizes"
BUFFER_ENTRIES = frozenset(
    (OPEN, OPEN_SIZES, READY, READY_SIZES, SPAN, EXHAUSTED, RESERVED, REFS, SECTIONS, INHERITED, INHERITED_SIZES)
    + (BASE_PROGRESS, EVENTS, EVENT_ORIGINS)
)
"""Every entry that holds a packer's buffer, in each form of its state (lists, compact, an
earlier state and the events since)."""
# Counters, in both modes.
STATS = "stats"

DOCUMENTS = "documents"
SPLIT = "split"
TRUNCATED = "truncated"
DROPPED = "dropped"
EMPTY = "empty"
ROWS = "rows"
PADDING = "padding"
COUNTERS = (DOCUMENTS, SPLIT, TRUNCATED, DROPPED, EMPTY, ROWS, PADDING)
DOCUMENT_COUNTERS = (DOCUMENTS, SPLIT, TRUNCATED, DROPPED, EMPTY)
