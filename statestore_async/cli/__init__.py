"""The ``statestore-async`` command (``main``), its offline checks on files (``offline``) and the demo job (``demo``)."""
