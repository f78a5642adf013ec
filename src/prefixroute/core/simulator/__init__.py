"""The fleet simulator: workloads, block keys, the discrete-event simulation and its metrics.

* :mod:`~prefixroute.core.simulator.request` the request model;
* :mod:`~prefixroute.core.simulator.keys` a request's block keys (the one place they are made);
* :mod:`~prefixroute.core.simulator.generators` seeded workloads (the worked examples and
  the design scenario of docs/concepts.md);
* :mod:`~prefixroute.core.simulator.simulation` replicas x policy over a request stream;
* :mod:`~prefixroute.core.simulator.metrics` what a run measured;
* :mod:`~prefixroute.core.simulator.repro_fleet` the fleet hit-rate example's figures.

Trace files are read by :mod:`prefixroute.edges.traces`.
"""
