"""Audit of a node's data with Spark (docs/operations.md, "Audit").

``snapshot`` (pyarrow only) is what the live node uses; ``source``, ``checks`` and ``job``
import pyspark and are imported only by ``python -m node audit`` and ``spark-submit``.
"""

# The checks' names, here (no pyspark) so that the node can validate a posted summary.
CHECKS = (
    "index",
    "crc",
    "unindexed",
    "garbage",
    "pinned",
    "retention",
    "offload",
    "holes",
    "replicas",
)
# Checks that need the replicated ledgers' metadata (node.audit.fleet) besides the snapshots.
FLEET_CHECKS = ("replicas",)
