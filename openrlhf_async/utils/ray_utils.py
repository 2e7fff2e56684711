"""Waiting on Ray work without hanging behind a failed actor."""


def get_all(refs: list, timeout_s: float = None) -> list:
    """Results of all refs in order; raises the first failure as soon as it happens (not after the others)."""
    import ray

    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
        if not done:
            raise TimeoutError(f"{len(pending)} Ray tasks did not finish within {timeout_s} s")
        ray.get(done)  # re-raises the task's error here
    return ray.get(list(refs))


def root_cause(exc: BaseException) -> str:
    """One line naming what failed: the innermost error of a Ray task failure."""
    cause = exc
    while getattr(cause, "cause", None) is not None and cause.cause is not cause:
        cause = cause.cause
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}"
