"""``python -m statestore_async.cli`` runs the ``statestore-async`` command."""
from statestore_async.cli.main import main

main()
