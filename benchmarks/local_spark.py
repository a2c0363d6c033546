"""The Spark session every Spark benchmark runs on: local[2], loopback only, 2 shuffle partitions,
no UI, its scratch under the benchmark's work folder, Python workers on this interpreter."""
from __future__ import annotations

import os
import sys
from collections.abc import Iterable


def local_session(app: str, work: str, *, driver_memory: str = "8g", conf: Iterable[tuple[str, str]] = ()):
    """A ``SparkSession`` named ``app`` with its local dir in ``work/tmp`` and the extra ``conf``
    settings, logging errors only."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.master("local[2]").appName(app).config("spark.ui.enabled", "false")
               .config("spark.driver.memory", driver_memory).config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1").config("spark.sql.shuffle.partitions", "2")
               .config("spark.ui.showConsoleProgress", "false").config("spark.local.dir", os.path.join(work, "tmp")))
    for key, value in conf:
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark
