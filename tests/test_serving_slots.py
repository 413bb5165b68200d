"""Continuous batching on the device (dsv4_jax.serving.slots) and its loop (dsv4_jax.serving.scheduler): a request
written into a row changes that row only; rows sample with their own parameters and keys, so a seeded request gets
the same tokens in any row beside any others; greedy requests that join and leave a shared batch produce what
`Model.generate` produces for each alone; the decode chunk compiles once and makes no implicit transfers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax
from dsv4_jax import generation
from dsv4_jax.config import load_hf_config
from dsv4_jax.layer_scan import StackedLayers, unstack_layers
from dsv4_jax.serving import slots as device
from dsv4_jax.serving.scheduler import Request, Scheduler
from dsv4_jax.state import copy_row, init_state
from serving_runs import run_requests

ROWS = 4


@pytest.fixture(scope="module")
def model():
    return dsv4_jax.load(dtype="float32", max_seq_len=256, max_batch=ROWS)


def _random_like(tree, rng):
    def fill(x):
        if x.dtype == jnp.bool_:
            return jnp.asarray(rng.random(x.shape) < 0.5)
        if jnp.issubdtype(x.dtype, jnp.integer):
            return jnp.asarray(rng.integers(0, 1000, x.shape), x.dtype)
        return jnp.asarray(rng.standard_normal(x.shape), x.dtype)
    return jax.tree.map(fill, tree)


def _per_layer(state):
    layers = unstack_layers(state.layers) if isinstance(state.layers, StackedLayers) else state.layers
    return [layers, state.mtp, state.mtp_hidden, state.positions]


@pytest.mark.parametrize("scan_layers", [False, True])
def test_copy_row_changes_that_row_only(scan_layers):
    cfg = load_hf_config(dsv4_jax.DEFAULT_MODEL_DIR)
    rng = np.random.default_rng(7)
    big = _random_like(init_state(cfg, ROWS, 256, jnp.float32, scan_layers=scan_layers), rng)
    row = _random_like(init_state(cfg, 1, 256, jnp.float32, scan_layers=scan_layers), rng)
    assert isinstance(big.layers, StackedLayers) == scan_layers
    out = jax.jit(copy_row)(big, row, jnp.int32(0), jnp.int32(2))          # what slots.admit writes a row with
    leaves = [jax.tree.leaves(_per_layer(s)) for s in (big, row, out)]
    assert len(leaves[0]) == len(leaves[2]) > 10
    for before, new, after in zip(*leaves):
        before, new, after = np.asarray(before), np.asarray(new), np.asarray(after)
        np.testing.assert_array_equal(after[2], new[0])
        np.testing.assert_array_equal(np.delete(after, 2, axis=0), np.delete(before, 2, axis=0))


def _prompts(model, n, rng):
    tok = model.tokenizer
    words = "And it came to pass in those days that the LORD spake unto Moses saying".split()
    return [[tok.bos_id] + tok.encode(" ".join(rng.choice(words, size=int(rng.integers(1, 12)))))
            for _ in range(n)]


def test_greedy_rows_joining_and_leaving_match_generate(model):
    rng = np.random.default_rng(11)
    prompts = _prompts(model, 7, rng)                # more requests than rows: some wait for a free row
    budgets = [int(b) for b in rng.integers(3, 30, len(prompts))]
    expected = [model.generate([p], max_new_tokens=b).tokens[0] for p, b in zip(prompts, budgets)]
    eos = model.config.eos_token_id
    scheduler = Scheduler(model, chunk=4).start()
    try:
        got = run_requests(scheduler, [Request(prompt_ids=p, max_tokens=b, on_event=None, stop_token_ids=[eos])
                               for p, b in zip(prompts, budgets)])
        compiled = generation.generate_chunk._cache_size()
        again = run_requests(scheduler, [Request(prompt_ids=prompts[0], max_tokens=budgets[0], on_event=None,
                                         stop_token_ids=[eos])])
    finally:
        scheduler.stop()
    for (tokens, reason), want, budget in zip(got, expected, budgets):
        assert tokens == want
        assert reason == ("stop" if want[-1] == eos else "length")
    assert again[0][0] == expected[0]
    assert generation.generate_chunk._cache_size() == compiled        # joining and leaving never recompiles
    assert scheduler.stats["admitted"] == len(prompts) + 1


def test_requests_admitted_in_groups_match_generate(model):
    """admit_batch 4: seven requests submitted at once are prefilled in groups (padded to 1, 2 or 4 rows) and each
    still produces what Model.generate produces for it alone; a token budget of two rows of the longest prompt
    splits the groups further; a bad admit_batch is refused."""
    rng = np.random.default_rng(13)
    prompts = _prompts(model, 7, rng)
    budgets = [int(b) for b in rng.integers(3, 20, len(prompts))]
    expected = [model.generate([p], max_new_tokens=b).tokens[0] for p, b in zip(prompts, budgets)]
    eos = model.config.eos_token_id
    longest = max(len(p) for p in prompts)
    for admit_tokens, most_per_call in ((4096, 4), (2 * longest, 2)):
        scheduler = Scheduler(model, chunk=4, admit_batch=4, admit_tokens=admit_tokens)
        calls = []
        admit = scheduler._admit
        scheduler._admit = lambda group, free: calls.append(len(group)) or admit(group, free)
        scheduler.start()
        try:
            got = run_requests(scheduler, [Request(prompt_ids=p, max_tokens=b, on_event=None, stop_token_ids=[eos])
                                           for p, b in zip(prompts, budgets)])
        finally:
            scheduler.stop()
        assert [tokens for tokens, _ in got] == expected
        assert sum(calls) == scheduler.stats["admitted"] == len(prompts)
        assert scheduler.stats["admit_calls"] == len(calls) < len(prompts) and max(calls) == most_per_call, calls
    for bad in (3, 2 * ROWS):
        with pytest.raises(ValueError, match="admit_batch must be a power of two"):
            Scheduler(model, admit_batch=bad)


@pytest.mark.parametrize("prefix_cache", [0, 16 << 20])
def test_long_prompts_prefilled_in_steps_match_generate(prefix_cache):
    """prefill_step 16: two long prompts queued behind a short request are prefilled 16 tokens per turn of the loop
    while it generates, each its own steps one after the other (the second, with the prefix cache, continues the
    first's prompt from the cache), and every request still produces what Model.generate produces for it alone."""
    model = dsv4_jax.load(dtype="float32", max_seq_len=256, max_batch=ROWS, prefix_cache=prefix_cache)
    rng = np.random.default_rng(17)
    long_prompt = [model.tokenizer.bos_id] + rng.integers(5, 4000, 100).tolist()
    prompts = [_prompts(model, 1, rng)[0], long_prompt, long_prompt + rng.integers(5, 4000, 40).tolist()]
    budgets = [60, 5, 7]
    expected = [model.generate([p], max_new_tokens=b).tokens[0] for p, b in zip(prompts, budgets)]
    model.prefix_cache.clear()
    scheduler = Scheduler(model, chunk=4, prefill_step=16)
    steps, stepped = [], scheduler._step
    scheduler._step = lambda free, generating: steps.append(scheduler._stepping[0].prompt_ids) or stepped(free,
                                                                                                          generating)
    scheduler.start()
    try:
        got = run_requests(scheduler, [Request(prompt_ids=p, max_tokens=b, on_event=None) for p, b in
                                       zip(prompts, budgets)])
    finally:
        scheduler.stop()
    assert [tokens for tokens, _ in got] == expected
    head = len(prompts[1]) - 1                       # all but the last token; the second after the cached head
    rest = len(prompts[2]) - 1 - (head if prefix_cache else 0)
    assert [len(p) for p in steps] == [len(prompts[1])] * -(-head // 16) + [len(prompts[2])] * -(-rest // 16)
    assert scheduler.stats["admitted"] == scheduler.stats["admit_calls"] == 3


def test_prefill_in_steps_keeps_the_queue_order_and_drops_a_cancelled_request(model):
    """Driven turn by turn (no loop thread): while a long prompt is prefilled in steps no other request is
    admitted; a request cancelled between its steps is dropped and its row stays free; where no row is
    generating, a long prompt is prefilled at once."""
    rng = np.random.default_rng(19)
    short, other = _prompts(model, 2, rng)
    long_prompt = [model.tokenizer.bos_id] + rng.integers(5, 4000, 60).tolist()
    scheduler = Scheduler(model, chunk=4, prefill_step=16)
    requests = [Request(prompt_ids=p, max_tokens=30, on_event=lambda e: None) for p in (short, long_prompt, other)]
    scheduler.submit(requests)
    assert len(scheduler._admit_waiting()) == 1                          # the short one; the long one's first step
    assert scheduler._stepping[0] is requests[1] and list(scheduler._waiting) == [requests[2]]
    assert scheduler._admit_waiting() == [] and list(scheduler._waiting) == [requests[2]]     # its second step
    scheduler.cancel(requests[1])
    assert scheduler._admit_waiting() == [] and scheduler._stepping is None
    assert [o.request for o in scheduler._owners if o is not None] == [requests[0]]
    assert len(scheduler._admit_waiting()) == 1                          # then the next in the queue
    assert scheduler.busy_rows() == 2 and not scheduler._waiting
    idle = Scheduler(model, chunk=4, prefill_step=16)
    idle.submit([Request(prompt_ids=long_prompt, max_tokens=3, on_event=lambda e: None)])
    assert len(idle._admit_waiting()) == 1 and idle._stepping is None   # nothing generating: at once
    with pytest.raises(ValueError, match="prefill_step"):
        Scheduler(model, prefill_step=-1)


def test_seeded_request_samples_the_same_in_any_row(model):
    rng = np.random.default_rng(5)
    prompt, *others = _prompts(model, 4, rng)
    seeded = dict(prompt_ids=prompt, max_tokens=40, temperature=1.0, top_p=0.95, seed=2**40 + 17)
    scheduler = Scheduler(model, chunk=4).start()
    try:
        alone = run_requests(scheduler, [Request(on_event=None, **seeded)])[0][0]
        # Three other sampled requests first: the seeded one gets row 3, with other rows around it (two of them
        # leave early), and its choice index 0 is what makes its key, not its row.
        crowd = [Request(prompt_ids=p, max_tokens=m, temperature=0.8, seed=s, on_event=None)
                 for p, m, s in zip(others, (7, 40, 13), (1, 2, 3))]
        beside = run_requests(scheduler, crowd + [Request(on_event=None, **seeded)])
        other_choice = run_requests(scheduler, [Request(on_event=None, choice=1, **seeded)])[0][0]
    finally:
        scheduler.stop()
    assert len(alone) == 40
    assert beside[-1][0] == alone
    assert other_choice != alone                  # choice 1 of the same seed is another sample
    assert beside[0][0] != beside[1][0][:7]       # and the crowd sampled with their own keys


def test_per_row_sampling_parameters(model):
    """A greedy row beside a sampled one stays greedy, and a row's top_k = 1 is greedy too."""
    rng = np.random.default_rng(3)
    prompts = _prompts(model, 2, rng)
    greedy = model.generate([prompts[0]], max_new_tokens=20).tokens[0]
    scheduler = Scheduler(model, chunk=4).start()
    try:
        out = run_requests(scheduler, [Request(prompt_ids=prompts[0], max_tokens=20, on_event=None),
                               Request(prompt_ids=prompts[1], max_tokens=20, temperature=2.0, seed=9,
                                       on_event=None),
                               Request(prompt_ids=prompts[0], max_tokens=20, temperature=2.0, top_k=1, seed=9,
                                       on_event=None)])
    finally:
        scheduler.stop()
    assert out[0][0] == greedy == out[2][0]
    assert out[1][0] != model.generate([prompts[1]], max_new_tokens=20).tokens[0]


def test_the_shared_chunk_makes_no_implicit_transfers(model):
    slots = device.init_slots(model.init_state(), 4)
    halt = jnp.zeros((ROWS,), bool)
    kw = dict(cfg=model.config, ctx=model.context, max_seq_len=model.max_seq_len, chunk=4, logprobs=True, n_top=2)
    slots, _ = generation.generate_chunk(model.params, slots, halt, **kw)      # compile outside the guard
    with jax.transfer_guard("disallow"):
        slots, out = generation.generate_chunk(model.params, slots, halt, **kw)
    assert np.all(np.asarray(out.tokens) == -1)       # every row free: nothing produced


def test_speculative_rows_greedy_equal_generate_and_seeded_rows_keep_their_tokens(model):
    """With speculative decoding in the loop (k = 2), greedy rows still give Model.generate's tokens (as plain
    speculative decoding does for this model in float32: tests/test_speculative.py), and a seeded sampled row
    draws the same tokens alone and beside others."""
    rng = np.random.default_rng(17)
    prompts = _prompts(model, 5, rng)
    budgets = [int(b) for b in rng.integers(5, 40, len(prompts))]
    expected = [model.generate([p], max_new_tokens=b).tokens[0] for p, b in zip(prompts, budgets)]
    eos = model.config.eos_token_id
    seeded = dict(prompt_ids=prompts[0], max_tokens=30, temperature=0.8, seed=99, stop_token_ids=[eos])
    scheduler = Scheduler(model, chunk=3, speculative_tokens=2).start()
    try:
        got = run_requests(scheduler, [Request(prompt_ids=p, max_tokens=b, on_event=None, stop_token_ids=[eos])
                               for p, b in zip(prompts, budgets)])
        alone = run_requests(scheduler, [Request(on_event=None, **seeded)])[0][0]
        beside = run_requests(scheduler, [Request(prompt_ids=p, max_tokens=20, temperature=1.0, seed=s, on_event=None)
                                  for p, s in zip(prompts[1:3], (4, 5))] + [Request(on_event=None, **seeded)])
    finally:
        scheduler.stop()
    assert [tokens for tokens, _ in got] == expected
    assert beside[-1][0] == alone and len(alone) >= 1
    assert scheduler.stats["accepted_drafts"] > 0
    assert scheduler.stats["verify_steps"] < sum(len(t) for t, _ in got)     # fewer model steps than tokens
