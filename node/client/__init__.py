"""The client library of replicated ledgers: the metadata store (etcd) and, later,
the writer, reader and recovery that talk to the nodes. It runs in the caller's process and
imports nothing of the node's engine, so scripts and other venvs can use it."""
