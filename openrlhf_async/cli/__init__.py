"""The command-line entry points (`python -m openrlhf_async.cli.<name>`). A package missing from the environment
stops any of them with one line saying to run `make install`, not a traceback: the hook below is set when this
package is imported, before an entry point's own imports run."""

import sys


def missing_package(error: ModuleNotFoundError) -> int:
    """Print the one-line error for a package this environment lacks; the exit status. A module of this package
    missing is a bug, raised again as one."""
    if not is_missing_package(error):
        raise error
    print(f"error: the Python package '{error.name.split('.')[0]}' is missing from {sys.executable}'s environment: "
          "run `make install` and use .venv/bin/python", file=sys.stderr)
    return 2


def is_missing_package(error: BaseException) -> bool:
    """A third-party package is missing (a module of this package missing is a bug, shown as one)."""
    return (isinstance(error, ModuleNotFoundError) and bool(error.name)
            and error.name.split(".")[0] != "openrlhf_async")


def _excepthook(kind, error, tb, previous=sys.excepthook):
    if is_missing_package(error):
        sys.stderr.flush()
        missing_package(error)
        return
    previous(kind, error, tb)


sys.excepthook = _excepthook
