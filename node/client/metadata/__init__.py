"""The metadata store of replicated ledgers: the protocol (store.py), etcd's v3 JSON gateway
(etcd.py), an in-memory twin for unit tests (memory.py) and the compare-and-set loop (loop.py)."""
