"""Small stand-ins for what a runner hands routing policies, shared by the policy tests."""

from __future__ import annotations


class CountingCache:
    """A runner's view: the first ``held`` blocks of any prompt are cached."""

    def __init__(self, held: int):
        self.held = held

    def match(self, keys):
        return min(self.held, len(keys))

    def __len__(self):
        return self.held
