"""Seeded fault campaigns: schedules drawn from a seed, run against real daemons and a real S3
server while a nemesis injects faults, each checked against an oracle.

Each level is one module with the same interface (``LEVEL``, ``FAULTS``, ``PHASES``, ``Event``,
``Schedule``, ``Outcome``, ``draw``, ``Env``, ``run``, ``shrink``):

- ``store_level``: daemons and clients without Spark, driven by a model of the Spark driver's
  protocol (open at the manifest's version, write, commit, await durable, write the manifest;
  replay a batch that did not finish). Fast enough for thousands of schedules.
- ``spark_level``: the ``StatefulOperator`` in local Spark.

``benchmarks/campaign.py`` runs them (``--level store|spark|all``); ``docs/CAMPAIGN.md`` says what
each checks and how to replay a seed. Nothing in the product imports this package.
"""
