"""Emulated clusters: one machine's network namespaces as hosts, shaped links, CPU shares, and runs on them.

The capability's home, in two floors:

- ``runtime.cluster`` (with ``runtime.netprobe``), the runtime floor: namespaces, veth cables and the switch,
  ``tc`` shapers, link cuts and rates, interface counters, probes, per-host CPU groups, and the reader of the
  cluster facts a node is started with. Only the runtime layer creates or destroys namespaces and CPU groups, and
  fault injection (``runtime.faults``, a link cut) and the planner (rates, ``profile --cpus``) sit below this
  package, so that floor stays there.
- this package, a layer below ``app`` (``tests/unit/test_layers.py``): ``command`` (`trainscale cluster`: up,
  down, status, link, probe; the state records), ``owner`` (one lock per cluster name: who makes, uses or deletes
  it now), ``dilation`` (``cluster up --dilate-to`` and the projection of a
  run's times), ``wire`` (the kernel's bytes on the wire), ``seam`` (the one object a worker on a cluster installs
  around its mode's callbacks) and ``bench`` (the bench's grid keys ``cluster_hosts`` and ``bandwidth``).

`train --cluster` (one node per host, after the one pre-flight of ``app.preflight``) is ``app.cluster_launch``: it
runs on the app's pre-flight and node commands, so it sits in the app layer, above this package.
"""
