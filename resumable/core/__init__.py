"""The model every node builds on.

* ``node``: ``Node``, the iteration protocol, state assembly and the fluent methods;
* ``indexed``: ``IndexedNode``, random access and the cursor ``(epoch, position)``;
* ``state``: the state format, its keys and the checks that validate a loaded state;
* ``keys``: record keys, an item's provenance;
* ``protocols``: ``Leaf`` (the bottom of an indexed chain) and ``Rescalable`` (the nodes an
  elastic resume rescales).
"""
