"""``prefixroute``, the default routing policy: the replica where the request's first token is
expected soonest, with balance rules for a quiet fleet.

Modules, one concern each: :mod:`.params` (every setting, its meaning and source),
:mod:`.costs` (the cost terms), :mod:`.mirror` (the blocks sent to a replica and their
survival), :mod:`.queue` (the prefill queue sent to a replica and its learned speed),
:mod:`.load` (recent load), :mod:`.balance` (the balance rules) and :mod:`.policy` (the
decision). ``docs/routing-policy.md`` explains the design for a user and how it was found.
"""

from .balance import BalanceRule, ColdBalance, SessionMove, default_rules
from .params import PrefixRouteParams
from .policy import PrefixRoute

__all__ = ["BalanceRule", "ColdBalance", "PrefixRoute", "PrefixRouteParams", "SessionMove",
           "default_rules"]
