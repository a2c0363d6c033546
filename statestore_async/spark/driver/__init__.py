"""The driver: ``StatefulOperator`` (``operator``) and its steps per batch: the plan (``plan``),
the state a batch starts from (``startstate``), materialization (``materialize``), reports, fence
and manifest (``commit``), time-only batches (``timeonly``, ``batches``), progress, the I/O thread."""
