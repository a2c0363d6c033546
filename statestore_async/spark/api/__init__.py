"""What users write against: processors (``processors``), state variables (``variables``), timers
(``timers``), sinks (``sinks``), examples; and the internal interface the task runtime drives
variables and timers through (``lifecycle``)."""
