"""Load test of a running OpenAI-compatible server (`python -m dsv4_jax.serve`, or any other).

    python scripts/load_test.py --url http://127.0.0.1:8000/v1 --clients 1,4,16 --seconds 30 --out load.json
    python scripts/load_test.py --clients 1,8,32,64,128 --prompt-tokens 1024 --max-tokens 256 --out load.json

For each client count, that many threads each send streaming completions back to back for --seconds (a request
started before the end runs to completion): a prompt drawn from a fixed list (or, with --prompt-tokens N, N random
token ids below PROMPT_ID_LIMIT: the same lengths on any model and tokenizer), --max-tokens new tokens at
--temperature, usage reported in the stream. Measured per request: time to first token (request sent -> first
chunk with text), inter-token latency ((last text chunk - first) / (tokens - 1)), output tokens. Prints one row per
client count (requests/s, output tokens/s, TTFT and ITL p50 / p99, errors) and writes --out JSON with the machine,
the date and the server's model. Against `python -m dsv4_jax.serve` it also reads the device loop's time from
/health before and after each client count (LOOP_STATS): the shares of the wall time the loop spent waiting for
decode chunks (the device decoding, the host idle), admitting requests (prefill and first token) and on its own work
between chunks, and that host work per chunk.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import threading
import time

import httpx
import numpy as np
from held_out_prompts import HELD_OUT_PROMPTS

PROMPT_ID_LIMIT = 4096        # --prompt-tokens ids: within the official vocabulary and the packaged tokenizer's
LOOP_STATS = ("chunks", "busy_s", "chunk_wait_s", "admit_s", "dispatch_s")   # dsv4_jax.serving.scheduler's, /health
ADMISSION_STATS = ("admitted", "admit_calls")      # requests admitted, prefill calls that admitted them (--admit-batch)


def health(url: str) -> dict:
    """The server's /health (dsv4_jax.serve's: its device, stats, ...), or {} where it has none."""
    try:
        return httpx.get(url.removesuffix("/v1") + "/health", timeout=30).json()
    except (httpx.HTTPError, ValueError):
        return {}


def loop_stats(url: str) -> dict | None:
    """The server's device-loop counters (LOOP_STATS) from /health, or None where it has none."""
    stats = health(url).get("stats", {})
    if not all(k in stats for k in LOOP_STATS):
        return None
    return {k: stats[k] for k in LOOP_STATS + ADMISSION_STATS if k in stats}


def loop_shares(before: dict | None, after: dict | None, wall: float) -> dict:
    """What the device loop did during `wall` seconds: shares of the wall time waiting for decode chunks,
    launching them (a launch may wait on the device: scheduler.py says when), admitting requests
    and on the host's own work between chunks, and that host work per chunk (ms)."""
    if before is None or after is None:
        return {}
    d = {k: after[k] - before[k] for k in LOOP_STATS}
    host = d["busy_s"] - d["chunk_wait_s"] - d["admit_s"] - d["dispatch_s"]
    shares = {"chunks": d["chunks"], "chunk_wait_share": d["chunk_wait_s"] / wall,
              "dispatch_share": d["dispatch_s"] / wall, "admit_share": d["admit_s"] / wall, "host_share": host / wall,
              "host_ms_per_chunk": 1e3 * host / d["chunks"] if d["chunks"] else None}
    if all(k in before and k in after for k in ADMISSION_STATS):
        calls = after["admit_calls"] - before["admit_calls"]
        shares["requests_per_admit_call"] = (after["admitted"] - before["admitted"]) / calls if calls else None
    return shares


def one_request(client: httpx.Client, url: str, model: str, prompt: str, args) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    with client.stream("POST", url + "/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:200]}"}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return {"error": event["error"]["message"]}
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event["choices"] and event["choices"][0]["text"]:
                last = time.perf_counter()
                first = first or last
    if first is None:
        return {"error": "no text"}
    return {"ttft": first - t0, "itl": (last - first) / (tokens - 1) if tokens > 1 else None, "tokens": tokens,
            "latency": time.perf_counter() - t0}


def run_clients(url: str, model: str, clients: int, args) -> dict:
    results: list[dict] = []
    lock = threading.Lock()
    start = time.perf_counter()
    end = start + args.seconds

    def client_loop(k: int):
        rng = random.Random(k)
        long = k == 0 and args.long_prompt_tokens > 0
        n_tokens = args.long_prompt_tokens if long else args.prompt_tokens
        with httpx.Client(timeout=args.timeout) as client:
            while time.perf_counter() < end:
                prompt = ([rng.randrange(PROMPT_ID_LIMIT) for _ in range(n_tokens)] if n_tokens
                          else rng.choice(HELD_OUT_PROMPTS))
                try:
                    out = one_request(client, url, model, prompt, args)
                except httpx.HTTPError as err:
                    out = {"error": f"{type(err).__name__}: {err}"}
                with lock:
                    results.append({**out, "long": long})
    before = loop_stats(url)
    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    loop = loop_shares(before, loop_stats(url), wall)
    done = [r for r in results if "error" not in r]
    ok = [r for r in done if not r["long"]]               # the long client's requests are reported apart
    long = [r for r in done if r["long"]]
    pct = lambda values, q: float(np.percentile(values, q)) * 1e3 if values else None  # noqa: E731
    ttft = [r["ttft"] for r in ok]
    itl = [r["itl"] for r in ok if r["itl"] is not None]
    row = {"clients": clients, "wall_s": wall, "requests": len(ok), "errors": len(results) - len(done),
           "error_examples": sorted({r["error"] for r in results if "error" in r})[:3],
           "requests_per_s": len(ok) / wall, "output_tokens_per_s": sum(r["tokens"] for r in done) / wall,
           "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99), "itl_ms_p50": pct(itl, 50),
           "itl_ms_p99": pct(itl, 99), **loop}
    if args.long_prompt_tokens:
        row |= {"long_requests": len(long), "long_ttft_ms_p50": pct([r["ttft"] for r in long], 50),
                "long_ttft_ms_max": pct([r["ttft"] for r in long], 100)}
    return row


def _loop_columns(row: dict) -> str:
    """The device loop's shares of the wall time (blank for a server that does not report them)."""
    if "chunk_wait_share" not in row:
        return ""
    per_chunk = f"{row['host_ms_per_chunk']:.2f} ms" if row["host_ms_per_chunk"] is not None else "-"
    shares = (row["chunk_wait_share"], row["dispatch_share"], row["admit_share"], row["host_share"])
    return " ".join(f"{100 * s:>5.0f}%" for s in shares) + f" {per_chunk:>10}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--clients", default="1,4,16", help="comma-separated client counts, run one after another")
    p.add_argument("--seconds", type=float, default=30.0, help="how long each client count sends requests")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=0, metavar="N",
                   help="prompts of N random token ids instead of the held-out texts (0: the texts)")
    p.add_argument("--long-prompt-tokens", type=int, default=0, metavar="N",
                   help="client 0 sends prompts of N random token ids instead (e.g. 32768 beside 1,024-token "
                        "prompts: what a long prompt's prefill does to the other streams' inter-token time); its "
                        "requests are counted apart (long_*) and in the output tokens (0: off)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--out", help="write the results as JSON")
    args = p.parse_args(argv)
    if args.prompt_tokens < 0 or args.long_prompt_tokens < 0:
        p.error(f"--prompt-tokens and --long-prompt-tokens must be >= 0, got {args.prompt_tokens} and "
                f"{args.long_prompt_tokens}")
    url = args.url.rstrip("/")
    try:
        model = httpx.get(url + "/models", timeout=30).json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, ValueError) as err:
        raise SystemExit(f"error: no OpenAI-compatible server at {url}: {err}") from None
    rows = []
    prompts = f"{args.prompt_tokens}-token prompts" if args.prompt_tokens else "held-out text prompts"
    print(f"{url}, model {model!r}, {prompts}, {args.max_tokens} tokens per request, temperature {args.temperature}")
    print(f"{'clients':>7} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
          f"{'ITL p99':>8} {'errors':>6}  {'wait':>6} {'launch':>6} {'admit':>6} {'host':>6} {'host/chunk':>10}")
    fmt = lambda v: f"{v:.1f}" if v is not None else "-"  # noqa: E731
    for clients in (int(c) for c in args.clients.split(",")):
        row = run_clients(url, model, clients, args)
        rows.append(row)
        print(f"{clients:>7} {row['requests_per_s']:>7.2f} {row['output_tokens_per_s']:>9.1f} "
              f"{fmt(row['ttft_ms_p50']):>9} {fmt(row['ttft_ms_p99']):>9} {fmt(row['itl_ms_p50']):>8} "
              f"{fmt(row['itl_ms_p99']):>8} {row['errors']:>6}  {_loop_columns(row)}", flush=True)
        if args.long_prompt_tokens:
            print(f"        the long client: {row['long_requests']} requests of {args.long_prompt_tokens} tokens, "
                  f"TTFT p50 {fmt(row['long_ttft_ms_p50'])} ms, max {fmt(row['long_ttft_ms_max'])} ms", flush=True)
        for example in row["error_examples"]:
            print(f"        error: {example}")
    if args.out:
        server = health(url)
        meta = {"date": datetime.date.today().isoformat(), "machine": platform.node(), "processor":
                platform.processor() or platform.machine(), "server_device": server.get("device"),
                "server_source_sha256": server.get("source_sha256"), "url": url,
                "model": model,
                "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens,
                "long_prompt_tokens": args.long_prompt_tokens, "temperature": args.temperature,
                "seconds": args.seconds}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
