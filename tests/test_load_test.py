"""scripts/load_test.py against a server in this process: the rows it reports count what the server did (requests,
output tokens from the streamed usage, the device loop's time from /health), with --prompt-tokens' random token
ids."""

import json
import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))

import load_test  # noqa: E402
from serving_runs import serving  # noqa: E402

from dsv4_jax.source_digest import source_digest  # noqa: E402


@pytest.fixture()
def server_url():
    import dsv4_jax
    from dsv4_jax.serving.scheduler import Scheduler
    model = dsv4_jax.load(dtype="float32", max_seq_len=256, max_batch=2)
    scheduler = Scheduler(model, chunk=4, max_queue=8).start()
    with serving(scheduler, "dsv4-default") as url:
        yield url + "/v1"


def test_load_test_reports_what_the_server_did(server_url, tmp_path, capsys):
    """--prompt-tokens 40: prompts of token ids (the text prompts take the server's text path, tested there)."""
    prompt_tokens = 40
    out = tmp_path / "load.json"
    load_test.main(["--url", server_url, "--clients", "1,2", "--seconds", "1", "--max-tokens", "5",
                    "--temperature", "0", "--prompt-tokens", str(prompt_tokens), "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["meta"]["prompt_tokens"] == prompt_tokens and result["meta"]["model"] == "dsv4-default"
    assert result["meta"]["server_device"].endswith(jax.devices()[0].device_kind)
    assert result["meta"]["server_source_sha256"] == source_digest()["sha256"]
    for row, clients in zip(result["rows"], (1, 2)):
        assert row["clients"] == clients and row["errors"] == 0 and row["requests"] >= clients
        produced = row["output_tokens_per_s"] * row["wall_s"]            # (a request may end early on EOS)
        assert row["requests"] <= produced <= 5 * row["requests"] + 1e-6
        assert row["ttft_ms_p50"] > 0 and (row["itl_ms_p50"] is None or row["itl_ms_p50"] > 0)
        # the device loop's time from /health: every request was admitted and decoded within the wall time
        assert row["chunks"] >= 1 and row["host_ms_per_chunk"] > 0
        shares = (row["chunk_wait_share"], row["dispatch_share"], row["admit_share"], row["host_share"])
        assert all(0 <= s for s in shares) and row["admit_share"] > 0 and row["dispatch_share"] > 0
        # (loosely: a pass of the previous client count may end after this count's first /health read)
        assert sum(shares) <= 1.5
    assert "40-token prompts" in capsys.readouterr().out


def test_the_long_client_is_counted_apart(server_url, tmp_path, capsys):
    """--long-prompt-tokens 150: client 0 sends 150-token prompts, reported in long_* and in the output tokens;
    the other clients' 20-token requests are the rows' requests, TTFT and inter-token times."""
    out = tmp_path / "load.json"
    load_test.main(["--url", server_url, "--clients", "2", "--seconds", "1", "--max-tokens", "5", "--temperature",
                    "0", "--prompt-tokens", "20", "--long-prompt-tokens", "150", "--out", str(out)])
    result = json.loads(out.read_text())
    row = result["rows"][0]
    assert result["meta"]["long_prompt_tokens"] == 150
    assert row["errors"] == 0 and row["requests"] >= 1 and row["long_requests"] >= 1
    assert row["long_ttft_ms_max"] >= row["long_ttft_ms_p50"] > 0
    produced = row["output_tokens_per_s"] * row["wall_s"]
    assert row["requests"] + row["long_requests"] <= produced <= 5 * (row["requests"] + row["long_requests"]) + 1e-6
    assert "the long client:" in capsys.readouterr().out
