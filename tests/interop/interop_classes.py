"""Classes shardkit does not model; torch files holding them must still load
in C++, and what C++ writes back must load in torch as the same objects."""


class Foreign:
    def __init__(self, name, payload):
        self.name = name
        self.payload = payload

    def __eq__(self, other):
        return type(other) is Foreign and vars(self) == vars(other)


class ForeignList(list):
    """A list subclass: pickled with APPENDS onto the object."""


class TensorReference:
    """Stands in for torch_xla's xser TensorReference (same pickled shape)."""

    def __init__(self, tid):
        self.tid = tid
