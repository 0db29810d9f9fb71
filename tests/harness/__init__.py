"""What every test of the node shares, one copy each:

- node.py: the node as a real process on loopback (NodeProcess) and the reap_nodes fixture
- clients.py: reads of what a node holds (read_ledger, read_stream) and the crash clients' kit
- settings.py: make_settings, the node's settings for in-process tests
- hostdisk.py: settings that make tests independent of the host disk; runs of the CLI
- loopdev.py: loop devices, for small file systems that fill and raw-device WALs
- moto.py: moto's S3 server, buckets and clients
- etcd.py: a real single-member etcd (tests/client's metadata store); pause, kill, restart
- metrics.py: scraping /metrics
- ports.py: free loopback ports
- files.py: damage to files on disk (flipped bytes)
- clock.py: the fake clock

Fixtures stay in the conftest.py files, built from these.
"""
