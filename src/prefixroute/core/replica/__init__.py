"""The replica model, shared by the fleet simulator and the engine emulator.

:mod:`~prefixroute.core.replica.service_time` says how long an engine step takes (presets with
their sources, profiles from dicts); :mod:`~prefixroute.core.replica.engine` schedules requests
over a :class:`~prefixroute.core.caches.paged_pool.PagedBlockPool` with vLLM's continuous
batching, chunked prefill and preemption. Time is always passed in.
"""
