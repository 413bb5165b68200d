"""A multi-turn conversation through the server, with and without the prefix cache: time to first token per turn.

    python benchmarks/prefix_cache_chat.py --turns 10 --out docs/bench/prefix_cache_chat.json \
        --plot docs/prefix_cache.png

For each setting (`--prefix-cache 0` and the server's default) it starts `python -m dsv4_jax.serve` on a free port,
holds one conversation with the real `openai` client (a long system prompt, then --turns user turns; each reply of
--max-tokens tokens at temperature 0 goes back into the history, as a chat client sends it), and measures each
turn's time to first token (request sent -> first streamed text) and the usage it reports
(`prompt_tokens_details.cached_tokens`). A conversation runs twice per server and the second is reported
(the first, with another system prompt, compiles the prefill programs of each new chunk length).
Then the last turn's request is sent once more (a resent request: all of its prompt but the last token cached).
Prints a table, writes JSON (date, machine, command) and, with --plot, a PNG.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import time

import httpx
import openai

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM = ("You are the assistant of a small library. You answer questions about its books, its opening hours and "
          "its rules. ") + " ".join(f"Rule {i}: a reader may borrow up to {i % 7 + 2} books of shelf {i} for "
                                    f"{i % 4 + 1} weeks, renewable once." for i in range(1, 60))
QUESTIONS = ["Who may borrow books?", "How long can I keep a book from shelf 3?", "And from shelf 12?",
             "Can I renew it?", "What about shelf 40?", "How many books from shelf 7?", "Is shelf 59 special?",
             "Which shelf allows the most books?", "Summarise the rules for shelf 21.", "Thank you. Anything else?"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(prefix_cache: str, max_seq_len: int) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dsv4_jax.serve", "--port", str(port), "--dtype", "float32",
                             "--max-seq-len", str(max_seq_len), "--max-batch", "1", "--prefix-cache", prefix_cache],
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit("the server did not start in 900 s")


def _turn(client, messages, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    stream = client.chat.completions.create(model="dsv4-default", messages=messages, max_tokens=max_tokens,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(choice.delta.content)
    return {"ttft_s": ttft, "total_s": time.perf_counter() - t0, "reply": "".join(text),
            "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.prompt_tokens_details.cached_tokens}


def conversation(url: str, turns: int, max_tokens: int, system: str = SYSTEM) -> tuple[list[dict], dict]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    messages = [{"role": "system", "content": system}]
    rows = []
    for i in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
        row = _turn(client, messages, max_tokens)
        rows.append({k: v for k, v in row.items() if k != "reply"})
        messages.append({"role": "assistant", "content": row["reply"]})
    resent = _turn(client, messages[:-1], max_tokens)
    return rows, {k: v for k, v in resent.items() if k != "reply"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--out", help="write JSON here")
    p.add_argument("--plot", help="write a PNG here")
    args = p.parse_args()
    result = {"date": datetime.date.today().isoformat(), "command": " ".join(["python"] + sys.argv),
              "machine": {"host": platform.node(), "cpu_count": os.cpu_count(), "processor": platform.machine()},
              "settings": {}}
    for name, size in (("off", "0"), ("on", "1G")):
        proc, url = _start_server(size, args.max_seq_len)
        try:
            # compiles (another system prompt: nothing of it prefixes the measured conversation)
            conversation(url, args.turns, args.max_tokens, system="A warm-up conversation. " + SYSTEM)
            rows, resent = conversation(url, args.turns, args.max_tokens)
            health = httpx.get(url + "/health").json()
        finally:
            proc.terminate()
            proc.wait(30)
        result["settings"][name] = {"prefix_cache": size, "turns": rows, "resent": resent,
                                    "health_prefix_cache": health.get("prefix_cache")}
    off, on = result["settings"]["off"]["turns"], result["settings"]["on"]["turns"]
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT off s':>11} {'TTFT on s':>10}")
    for i, (a, b) in enumerate(zip(off, on, strict=True)):
        print(f"{i + 1:>4} {b['prompt_tokens']:>7} {b['cached_tokens']:>7} {a['ttft_s']:>11.3f} {b['ttft_s']:>10.3f}")
    r = result["settings"]["on"]["resent"]
    print(f"resent last turn: {r['cached_tokens']} of {r['prompt_tokens']} prompt tokens cached, TTFT "
          f"{r['ttft_s']:.3f} s (without the cache {result['settings']['off']['resent']['ttft_s']:.3f} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        turns = range(1, len(on) + 1)
        ax.plot(turns, [t["ttft_s"] for t in off], "o-", label="prefix cache off (--prefix-cache 0)")
        ax.plot(turns, [t["ttft_s"] for t in on], "s-", label="prefix cache on (default)")
        ax.set_xlabel("turn of the conversation")
        ax.set_ylabel("time to first token, s")
        ax.set_title(f"default model, 2-core CPU, {result['date']}", fontsize=9)
        ax.set_ylim(bottom=0)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
