"""Fault runs against a local cluster, Jepsen's way: clients log every operation as a history
(proxy.py puts the network faults between them and the nodes), a nemesis breaks things, and a
checker reads everything back from fresh clients and says what the history contradicts."""
