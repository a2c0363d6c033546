"""The task runtime: one ``mapInArrow`` task per state partition (``partition``), its rows grouped
by key (``grouping``), the per-key and vectorized runs (``perkey``, ``vectorized``), the output
table (``output``), batched store calls (``storecalls``), due timers and TTL cleanup (``timers``)."""
