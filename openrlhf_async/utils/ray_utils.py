"""Waiting on Ray work without hanging behind a failed actor."""

import signal
import threading

# Set by the CLI's Ctrl-C handler. Ray runs Python's signal handlers from inside its own waits and turns the
# KeyboardInterrupt into a status that some of its waits drop, so a Ctrl-C can be lost; loops that wait on Ray
# check this as well.
INTERRUPTED = threading.Event()


def catch_interrupts() -> None:
    """Ctrl-C (SIGINT) raises KeyboardInterrupt as usual and is also remembered in INTERRUPTED. Only the main
    thread may set a signal handler: a run started from another thread (a benchmark driving the CLI) keeps
    Python's default."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_interrupt(signum, frame):
        INTERRUPTED.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_interrupt)


def raise_if_interrupted() -> None:
    if INTERRUPTED.is_set():
        raise KeyboardInterrupt


def on_this_node() -> dict:
    """Actor options that keep an actor on the caller's node: the run's control actors (fleet, generator, trainer
    loop, queues) live with the driver, so a worker node lost takes only engines or ranks with it. No CPU of
    their own: they only wait on others."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}


def get_all(refs: list, timeout_s: float = None) -> list:
    """Results of all refs in order; raises the first failure as soon as it happens (not after the others)."""
    import ray

    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
        if not done:
            raise TimeoutError(f"{len(pending)} Ray tasks did not finish within {timeout_s} s")
        try:
            ray.get(done)
        except ray.exceptions.ActorDiedError:
            raise
        except Exception as error:
            raise _dead_actor_error(pending) or error from None
    return ray.get(list(refs))


def _dead_actor_error(pending: list, grace_s: float = 5.0):
    """When one member of a collective dies, the others fail too, often first (their connection closes): the dead
    actor is the cause worth reporting, so look for it among the refs still pending."""
    import ray

    done, _ = ray.wait(pending, num_returns=len(pending), timeout=grace_s) if pending else ([], [])
    for ref in done:
        try:
            ray.get(ref)
        except ray.exceptions.ActorDiedError as died:
            return died
        except Exception:
            pass
    return None


def root_cause(exc: BaseException) -> str:
    """One line naming what failed: the innermost error of a Ray task failure."""
    cause = exc
    while getattr(cause, "cause", None) is not None and cause.cause is not cause:
        cause = cause.cause
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}"


def actor_died(error: BaseException) -> bool:
    """Whether an actor's death is behind this failure (anywhere in its chain of causes)."""
    from ray.exceptions import RayActorError

    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, RayActorError):
            return True
        seen.add(id(error))
        error = getattr(error, "cause", None) or error.__cause__
    return False
