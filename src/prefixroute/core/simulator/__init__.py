"""The fleet simulator: workloads, block keys, the discrete-event simulation and its metrics.

* :mod:`~prefixroute.core.simulator.request` the request model;
* :mod:`~prefixroute.core.simulator.keys` a request's block keys (the one place they are made);
* :mod:`~prefixroute.core.simulator.generators` seeded workloads (SPEC sections 3 and 4);
* :mod:`~prefixroute.core.simulator.simulation` replicas x policy over a request stream;
* :mod:`~prefixroute.core.simulator.metrics` what a run measured;
* :mod:`~prefixroute.core.simulator.repro_fleet` SPEC section 3 item 4's figures.

Trace files are read by :mod:`prefixroute.edges.traces`.
"""
