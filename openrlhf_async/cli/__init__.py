"""The command-line entry points (`python -m openrlhf_async.cli.<name>`). A package missing from the environment
stops any of them with one line saying to run `make install`, not a traceback: the hook below is set when this
package is imported, before an entry point's own imports run."""

import sys


def missing_package(error: ModuleNotFoundError) -> int:
    """Print the one-line error for a package this environment lacks; the exit status."""
    print(f"error: the Python package '{error.name.split('.')[0]}' is missing from {sys.executable}'s environment: "
          "run `make install` and use .venv/bin/python", file=sys.stderr)
    return 2


def _excepthook(kind, error, tb, previous=sys.excepthook):
    if issubclass(kind, ModuleNotFoundError) and error.name and not error.name.startswith("openrlhf_async"):
        sys.stderr.flush()
        missing_package(error)
        return
    previous(kind, error, tb)


sys.excepthook = _excepthook
