"""Run requests through a serving scheduler and collect what each got (for the tests and sharded_checks)."""

import threading

from dsv4_jax.serving.scheduler import Failed, Finished, Tokens


def run_requests(scheduler, requests, timeout=300):
    """Submit `requests` (their on_event is replaced) and wait; returns each one's (token ids, finish reason), or
    (token ids, the failure message)."""
    results = {}
    done = threading.Event()

    def recorder(k):
        tokens = []

        def on_event(event):
            if isinstance(event, Tokens):
                tokens.extend(event.token_ids)
            elif isinstance(event, (Finished, Failed)):
                results[k] = (tokens, event.reason if isinstance(event, Finished) else event.message)
                if len(results) == len(requests):
                    done.set()
        return on_event
    for k, r in enumerate(requests):
        r.on_event = recorder(k)
    scheduler.submit(requests)
    assert done.wait(timeout), "requests did not finish"
    return [results[k] for k in range(len(requests))]
