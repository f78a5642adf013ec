"""Shared routing state and rate limits for several router instances, on Redis.

:class:`~prefixroute.edges.shared_state.shared.SharedState` is what a router body plugs in;
``codec`` (the booking messages), ``apply`` (other instances' bookings onto the lifecycle
runner), ``stream`` (the Redis stream), ``ratelimit`` (fleet-wide token buckets) and ``link``
(the connection, its health and metrics) are its parts. ``redis`` is an optional dependency
(``pip install 'prefixroute[redis]'``): import this package only when shared state is on.
"""
