"""The pure core: hashing, caches, policies, replica model, simulator, economics, diagnostics.

Nothing under this package does I/O, reads the wall clock or sleeps; time comes in through
:class:`prefixroute.core.clock.Clock`.
"""
