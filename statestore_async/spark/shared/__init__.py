"""What the driver and the tasks share: routing to key groups and partitions (``routing``), the
node's daemon (``placement``), where partitions run (``coordinator``), event time (``eventtime``),
the task spec and report (``taskspec``), the hook points (``hooks``)."""
