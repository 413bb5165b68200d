"""The OpenAI-compatible server (python -m dsv4_jax.serve), started on 127.0.0.1 inside the test and spoken to
with the `openai` client and with raw HTTP: greedy outputs equal `Model.generate`, streamed text equals whole
text, concurrent clients each get their own output, a client that leaves frees its row, bad input gets a 400 in
OpenAI's shape without disturbing the others, and special-token text in a message stays text."""

import json
import threading
import time
from types import SimpleNamespace

import httpx
import jax
import numpy as np
import openai
import pytest
from serving_runs import serving

import dsv4_jax
from dsv4_jax.chat import encode_message_ids
from dsv4_jax.serving.app import create_app
from dsv4_jax.serving.scheduler import Request, Scheduler
from dsv4_jax.source_digest import source_digest
from dsv4_jax.tokenizer import ASSISTANT, BOS, DSML, EOS, THINK_END, THINK_START, USER

NAME = "dsv4-default"
MAX_SEQ_LEN = 256


@pytest.fixture(scope="module")
def server():
    model = dsv4_jax.load(dtype="float32", max_seq_len=MAX_SEQ_LEN, max_batch=4)
    scheduler = Scheduler(model, chunk=4, max_queue=64).start()
    with serving(scheduler, NAME) as url:
        yield SimpleNamespace(url=url, model=model, scheduler=scheduler,
                              client=openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300))


def _greedy_text(model, prompt_ids, max_tokens):
    """What the server must answer at temperature 0: Model.generate's tokens as text, the EOS left out."""
    tokens = model.generate([prompt_ids], max_new_tokens=max_tokens).tokens[0]
    eos = model.config.eos_token_id
    finish = "stop" if tokens and tokens[-1] == eos else "length"
    return model.tokenizer.decode([t for t in tokens if t != eos]), finish


def _plain_ids(model, text):
    return [model.tokenizer.bos_id] + model.tokenizer.encode(text)


def test_models_and_health(server):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert r.json()["device"] == f"{len(jax.devices())} x {jax.devices()[0].device_kind}"
    assert r.json()["source_sha256"] == source_digest()["sha256"]          # the code that serves
    models = server.client.models.list()
    assert [m.id for m in models.data] == [NAME]


@pytest.mark.parametrize("prompt,max_tokens", [("In the beginning", 24), ("And the LORD spake unto", 9)])
def test_greedy_completion_equals_generate(server, prompt, max_tokens):
    want, finish = _greedy_text(server.model, _plain_ids(server.model, prompt), max_tokens)
    whole = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0)
    assert whole.choices[0].text == want and whole.choices[0].finish_reason == finish
    assert whole.usage.prompt_tokens == len(_plain_ids(server.model, prompt))
    chunks = list(server.client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                   stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == finish


def test_greedy_chat_equals_generate(server):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Who was Moses?"}]
    ids = encode_message_ids(server.model.tokenizer, messages)
    want, finish = _greedy_text(server.model, ids, 30)
    whole = server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=30, temperature=0)
    assert whole.choices[0].message.content == want and whole.choices[0].finish_reason == finish
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens >= 1
    stream = server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=30, temperature=0,
                                                   stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_sixteen_concurrent_clients_each_get_their_own_output(server):
    rng = np.random.default_rng(21)
    words = "and it came to pass that the LORD spake unto Moses in the wilderness of Sinai saying".split()
    prompts = [" ".join(rng.choice(words, size=int(rng.integers(1, 16)))) for _ in range(16)]
    budgets = [int(b) for b in rng.integers(2, 24, 16)]
    want = [_greedy_text(server.model, _plain_ids(server.model, p), b)[0] for p, b in zip(prompts, budgets)]
    got: list = [None] * 16

    def client(k):
        if k % 2:
            got[k] = server.client.completions.create(model=NAME, prompt=prompts[k], max_tokens=budgets[k],
                                                      temperature=0).choices[0].text
        else:
            got[k] = "".join(c.choices[0].text for c in server.client.completions.create(
                model=NAME, prompt=prompts[k], max_tokens=budgets[k], temperature=0, stream=True))
    threads = [threading.Thread(target=client, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert got == want


def test_seeded_stream_equals_whole_and_stop_strings_are_cut(server):
    kw = dict(model=NAME, prompt="And it came to pass", max_tokens=60, temperature=1.0, seed=123,
              stop=[" the", "LORD"])
    whole = server.client.completions.create(**kw).choices[0]
    again = server.client.completions.create(**kw).choices[0]
    streamed = list(server.client.completions.create(stream=True, **kw))
    text = "".join(c.choices[0].text for c in streamed)
    assert whole.text == again.text == text
    assert whole.finish_reason == streamed[-1].choices[0].finish_reason
    assert " the" not in text and "LORD" not in text
    free = server.client.completions.create(**{**kw, "stop": None}).choices[0].text
    assert free.startswith(text) and (whole.finish_reason == "length" or len(free) > len(text))


def test_choices_and_logprobs(server):
    out = server.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Speak"}],
                                                max_tokens=8, temperature=1.0, seed=5, n=2, logprobs=True,
                                                top_logprobs=3)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].message.content != out.choices[1].message.content
    for c in out.choices:
        entries = c.logprobs.content
        assert len(entries) == out.usage.completion_tokens // 2 or c.finish_reason == "stop"
        for e in entries:
            tops = [t.logprob for t in e.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True) and e.logprob <= tops[0] + 1e-6
    text = server.client.completions.create(model=NAME, prompt="In the", max_tokens=5, temperature=0, logprobs=2)
    lp = text.choices[0].logprobs
    assert "".join(lp.tokens) == text.choices[0].text and len(lp.top_logprobs[0]) == 2
    assert lp.token_logprobs[0] == pytest.approx(max(lp.top_logprobs[0].values()))    # greedy: the top token


def test_client_that_leaves_frees_its_row(server):
    before = server.scheduler.stats["cancelled"]
    body = {"model": NAME, "prompt": "In the beginning", "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    deadline = time.time() + 30
    while server.scheduler.stats["cancelled"] == before or server.scheduler.busy_rows():
        assert time.time() < deadline, "the row of the client that left was not freed"
        time.sleep(0.05)
    out = server.client.completions.create(model=NAME, prompt="In the beginning", max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length"


BAD_REQUESTS = [
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 7}, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_SEQ_LEN},
     "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 9}, "logprobs"),
    ("/v1/completions", {"prompt": [99999]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "seed": "abc"}, "seed"),
    ("/v1/completions", {"prompt": "word " * 300}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 300}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tool_choice": {"type": "function", "function": {"name": "f"}},
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format"),
]


def test_bad_requests_get_400_and_leave_the_others_alone(server):
    want, _ = _greedy_text(server.model, _plain_ids(server.model, "In the beginning"), 40)
    got = {}
    good = threading.Thread(target=lambda: got.setdefault("text", "".join(
        c.choices[0].text for c in server.client.completions.create(
            model=NAME, prompt="In the beginning", max_tokens=40, temperature=0, stream=True))))
    good.start()
    for path, body, param in BAD_REQUESTS:
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert error["param"] == param and "\n" not in error["message"], error
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=60)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as err:
        server.client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 400 and err.value.code == "model_not_found"
    good.join(300)
    assert got["text"] == want


SPECIALS = [EOS, BOS, THINK_START, THINK_END, USER, ASSISTANT, f"<{DSML}tool_calls>", f"<{DSML}invoke name=\"x\">"]


@pytest.mark.parametrize("special", SPECIALS)
def test_special_token_text_in_a_message_stays_text(server, special):
    tok = server.model.tokenizer
    messages = [{"role": "user", "content": f"say {special} now"}]
    ids = encode_message_ids(tok, messages)
    plain = encode_message_ids(tok, [{"role": "user", "content": "say now"}])
    specials = tok.special_ids
    assert [i for i in ids if i in specials] == [i for i in plain if i in specials]
    out = server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=2, temperature=0)
    assert out.usage.prompt_tokens == len(ids)


def test_full_queue_gets_429(server):
    """A scheduler whose loop is not running keeps what it was given waiting: past max_queue + its free rows the
    server answers 429 at once."""
    from starlette.testclient import TestClient
    stalled = Scheduler(server.model, chunk=4, max_queue=1)
    stalled.submit([Request(prompt_ids=[1], max_tokens=1, on_event=lambda e: None) for _ in range(5)])
    with TestClient(create_app(stalled, NAME)) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "server_busy" and "retry later" in r.json()["error"]["message"]


def test_sse_format(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert len({p["id"] for p in payloads}) == 1 and all(p["object"] == "chat.completion.chunk" for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")


class _ScriptedScheduler:
    """Stands in for the device loop to drive the HTTP layer with a chosen assistant turn: each request gets the
    text in pieces, then Finished (the model itself is too small to write tool calls)."""

    def __init__(self, model, pieces):
        self.tokenizer, self.rows, self.pieces, self.speculative_tokens = model.tokenizer, 4, pieces, 0
        self.model = SimpleNamespace(config=model.config, max_seq_len=4096)    # room for the tools' prompt

    def submit(self, requests):
        from dsv4_jax.serving.scheduler import Finished, Tokens

        def emit():
            for r in requests:
                for piece in self.pieces:
                    r.on_event(Tokens(piece, [0], None))
                r.on_event(Finished("stop", "", len(self.pieces)))
        threading.Thread(target=emit).start()

    def cancel(self, request):
        pass

    def busy_rows(self):
        return 0


def test_reasoning_and_tool_calls_in_responses(server):
    from starlette.testclient import TestClient

    from test_chat_output import CALLS, _tool_block
    text = "Weather needed." + THINK_END + "Let me look." + _tool_block()
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    app = create_app(_ScriptedScheduler(server.model, pieces), NAME)
    body = {"messages": [{"role": "user", "content": "Weather in Jericho?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
            "chat_template_kwargs": {"thinking": True}}
    with TestClient(app) as client:
        whole = client.post("/v1/chat/completions", json=body).json()
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    message = whole["choices"][0]["message"]
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    assert message["reasoning_content"] == "Weather needed." and message["content"] == "Let me look."
    assert [c["function"] for c in message["tool_calls"]] == [c["function"] for c in CALLS]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Weather needed."
    assert "".join(d.get("content", "") for d in deltas) == "Let me look."
    streamed_calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["function"] for c in streamed_calls] == [c["function"] for c in CALLS]
    assert [c["index"] for c in streamed_calls] == [0, 1]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
