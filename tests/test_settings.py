"""One route for options (dsv4_jax/settings.py): every option of a Model is a field of `Settings`, validated there
once with a one-line error, before any weight is read; load, init_random, Model, the command line and the server
take it; the run context (and with it the jit cache key) is made from it."""

from __future__ import annotations

import dataclasses

import pytest

import dsv4_jax
from dsv4_jax import generate as cli
from dsv4_jax.settings import Settings


@pytest.mark.parametrize("options, message", [
    (dict(dtype="float16"), "dtype must be one of"),
    (dict(act_quant="int4"), "act_quant must be one of"),
    (dict(kernels="gpu"), "kernels must be one of"),
    (dict(max_seq_len=0), "max_seq_len must be a positive integer, got 0"),
    (dict(max_batch=2.5), "max_batch must be a positive integer, got 2.5"),
    (dict(prefill_chunk=True), "prefill_chunk must be a positive integer, got True"),
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype must be one of"),
    (dict(track_mtp="yes"), "track_mtp must be True or False"),
    (dict(kernel_overrides=["attention_core=fast"]), "kernel override 'attention_core=fast': expected OP=CHOICE"),
])
def test_each_bad_option_is_a_one_line_error(options, message):
    with pytest.raises(ValueError, match=message) as err:
        Settings(**options)
    assert "\n" not in str(err.value)


def test_an_unknown_option_is_named():
    with pytest.raises(TypeError, match="unknown option max_seqlen"):
        Settings.of(max_seqlen=64)


def test_load_checks_the_options_before_reading_weights(tmp_path):
    # a directory that is no checkpoint: the option error comes first, so no weight was read to find it
    with pytest.raises(ValueError, match="max_batch must be a positive integer"):
        dsv4_jax.load(str(tmp_path), max_batch=0)


def test_settings_make_the_model_and_its_run_context():
    settings = Settings(dtype="float32", max_seq_len=128, max_batch=2, kernel_overrides={"mhc_site": "reference"})
    model = dsv4_jax.load(settings=settings)
    assert model.settings == settings
    assert (model.max_seq_len, model.max_batch, model.context.dtype) == (128, 2, "float32")
    assert model.context.kernels.overrides == (("mhc_site", "reference"),)
    # keywords and a Settings combine: the keywords win
    again = dsv4_jax.load(settings=settings, max_batch=1)
    assert again.settings == dataclasses.replace(settings, max_batch=1)


def test_the_command_line_refuses_a_bad_override_in_one_line(capsys):
    code = cli.main(["--prompt", "x", "--kernel-override", "attention=kernel"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == cli.EXIT_USAGE
    assert err == ["error: kernel override 'attention=kernel': expected OP=CHOICE with OP one of matmul, "
                   "act_quantize, mhc_site, norm_rope, attention_core, indexer_scores, indexer_top_k, compressor_step, "
                   "moe_ffn, head and "
                   "CHOICE one of kernel, reference"]


def test_max_seq_len_past_the_trained_positions_needs_asking_for():
    """One rule (Settings.check_context) for every entry: the default model was trained for 4,096 positions."""
    import dsv4_jax
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=4096.*allow_long_context"):
        dsv4_jax.load(max_seq_len=8192)
    model = dsv4_jax.load(max_seq_len=8192, allow_long_context=True)
    assert model.max_seq_len == 8192
    with pytest.raises(ValueError, match="allow_long_context must be True or False"):
        Settings(allow_long_context="yes")
