"""Audit of a node's data with Spark (SPEC.md section 9, README "Audit").

``snapshot`` (pyarrow only) is what the live node uses; ``source``, ``checks`` and ``job``
import pyspark and are imported only by ``python -m node audit`` and ``spark-submit``.
"""
