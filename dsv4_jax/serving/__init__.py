"""Serving: an OpenAI-compatible HTTP server over one static decode batch (continuous batching).

- `slots`: the device side. One decode state of `max_batch` rows; a request is prefilled alone and written into a
  free row; every row carries its own sampling parameters, stop tokens and random key.
- `scheduler`: the one device-loop thread: admits queued requests into free rows, runs decode chunks, hands each
  request its tokens and text.
- `protocol`: OpenAI request parsing and validation, and the error shape.
- `chat_output`: an assistant turn's text split into reasoning, content and tool calls, as it streams.
- `app`: the FastAPI application; `python -m dsv4_jax.serve` runs it with uvicorn.
"""
