"""Autorecovery (BookKeeper's Auditor and ReplicationWorkers, run by Airflow through a node's
admin routes or by ``python -m node shell``): under-replicated ledgers found, marked in the
metadata store and re-replicated. It imports node.client and nothing of the node's engine: it
runs inside a node and from the shell alike. Layout of its keys: markers.py."""

# The node's settings repeat these defaults (tests/autorecovery checks they agree); the shell
# uses them, since it reads no settings of a node.
DEFAULT_LOST_NODE_DELAY_S = 600  # BookKeeper's lostBookieRecoveryDelay is 0; 10 min spares restarts
DEFAULT_OPEN_LEDGER_GRACE_S = 30  # BookKeeper's openLedgerRereplicationGracePeriod (30 s)
DEFAULT_LOCK_TTL_S = 30
