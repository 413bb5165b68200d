"""Run requests through a serving scheduler and collect what each got (for the tests and sharded_checks)."""

import contextlib
import socket
import threading
import time

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


@contextlib.contextmanager
def serving(scheduler, model_name: str):
    """The OpenAI app of a started `scheduler` (serving.app.create_app) served by uvicorn on a free 127.0.0.1 port in
    a thread of this process; yields its base URL and stops it after (the scheduler too)."""
    import uvicorn

    from dsv4_jax.serving.app import create_app
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(scheduler, model_name), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        scheduler.stop()
